"""Peak resident memory a process adds while a block runs, from /proc/self/status."""

import threading
from typing import Dict


def resident_bytes() -> Dict[str, int]:
    """RssAnon (private) and VmRSS (private + file pages mapped in, e.g. an mmap'ed checkpoint)."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS"):
                found[key] = int(value.split()[0]) * 1024
    return found


class PeakMemory:
    """Peak resident memory added while the block runs, sampled every millisecond by a thread:
    `added("RssAnon")` and `added("VmRSS")`, in bytes, over what the process held when the
    PeakMemory was made."""

    def __init__(self):
        self.base = resident_bytes()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _sample(self):
        for key, value in resident_bytes().items():
            self.peak[key] = max(self.peak[key], value)

    def _watch(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    def added(self, key: str) -> int:
        return self.peak[key] - self.base[key]
