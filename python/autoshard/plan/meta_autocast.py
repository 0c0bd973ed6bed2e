"""torch.autocast on the meta device.

Models open `torch.autocast(device_type=x.device.type, ...)` inside forward (to keep a softmax
or a rotary table out of mixed precision). autoshard runs the forward on meta tensors, and
torch refuses an autocast region for device type "meta". While `meta_autocast()` is active, such
a region is opened for the CPU instead: it keeps its `enabled` and `dtype`, and since meta
tensors carry no CPU dispatch key, no op on them is cast; the shapes recorded are the model's.
"""

import contextlib
import threading

from torch.amp.autocast_mode import autocast

_lock = threading.Lock()
_depth = 0
_original_init = autocast.__init__


def _init_on_meta(self, device_type, *args, **kwargs):
    _original_init(self, "cpu" if device_type == "meta" else device_type, *args, **kwargs)


@contextlib.contextmanager
def meta_autocast():
    """While active, torch.autocast(device_type="meta") opens a CPU autocast region instead."""
    global _depth
    with _lock:
        if _depth == 0:
            autocast.__init__ = _init_on_meta
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                autocast.__init__ = _original_init
