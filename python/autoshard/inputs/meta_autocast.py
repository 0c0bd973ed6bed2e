"""torch.autocast on the meta device.

Models open `torch.autocast(device_type=x.device.type, ...)` inside forward (to keep a softmax
or a rotary table out of mixed precision). autoshard runs the forward on meta tensors, and
torch refuses an autocast region for device type "meta". While `meta_autocast()` is active in a
thread, such a region opened by that thread is opened for the CPU instead: it keeps its `enabled`
and `dtype`, and since meta tensors carry no CPU dispatch key, no op on them is cast; the shapes
recorded are the model's. autocast's constructor is replaced only while some thread is inside
(and for the others it is torch's own); it is torch's again when the last one leaves.
"""

import contextlib
import threading

from torch.amp.autocast_mode import autocast

_lock = threading.Lock()
_inside = threading.local()  # this thread's depth of meta_autocast()
_threads_inside = 0
_original_init = autocast.__init__


def _init_on_meta(self, device_type, *args, **kwargs):
    on_meta = device_type == "meta" and getattr(_inside, "depth", 0) > 0
    _original_init(self, "cpu" if on_meta else device_type, *args, **kwargs)


@contextlib.contextmanager
def meta_autocast():
    """While active, torch.autocast(device_type="meta") in this thread opens a CPU autocast region."""
    global _threads_inside
    depth = getattr(_inside, "depth", 0)
    if depth == 0:
        with _lock:
            if _threads_inside == 0:
                autocast.__init__ = _init_on_meta
            _threads_inside += 1
    _inside.depth = depth + 1
    try:
        yield
    finally:
        _inside.depth = depth
        if depth == 0:
            with _lock:
                _threads_inside -= 1
                if _threads_inside == 0:
                    autocast.__init__ = _original_init
