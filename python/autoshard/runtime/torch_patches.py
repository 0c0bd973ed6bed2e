"""torch's functions that autoshard reroutes for parallelized models, installed while one lives.

torch.nn.utils.clip_grad_norm_ (runtime/torch_clip.py) and GradScaler's unscaling
(runtime/grad_scaler_agreement.py) look their steps up in torch at each call, so replacing them
there reaches every caller, even one that imported them before autoshard. Importing autoshard
changes nothing in torch: the replacements go in when the first model is parallelized (a state
is attached) and come out when the last such model is gone; a call on anything else meanwhile
is torch's own.

This module's counter is the one registry of that job: how many attached states are alive.
"""

import threading
import weakref

from ..core.parallel_state import ParallelState, on_attach
from . import grad_scaler_agreement, torch_clip

_lock = threading.Lock()
_alive = 0


def _hold(state: ParallelState) -> None:
    global _alive
    with _lock:
        if _alive == 0:
            torch_clip.install()
            grad_scaler_agreement.install()
        _alive += 1
    weakref.finalize(state, _release)


def _release() -> None:
    global _alive
    with _lock:
        _alive -= 1
        if _alive == 0:
            torch_clip.remove()
            grad_scaler_agreement.remove()


def installed() -> bool:
    """Whether torch's clipping and GradScaler are rerouted now (a parallelized model lives)."""
    return torch_clip.is_installed() and grad_scaler_agreement.is_installed()


on_attach(_hold)
