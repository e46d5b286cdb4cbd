"""The ZeRO-3 working set: which units have their gathered (unsharded)
buffer allocated right now, with peaks, for tests, the demo and the estimator.

``handle`` adds a unit when it all-gathers and removes it when it frees the
buffer; nothing else writes here.
"""
from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # handle imports this module, not the other way round
    from .handle import FlatParamHandle


class LiveUnshardedTracker:
    """Which units have their unsharded buffer allocated: the ZeRO-3 working
    set of this process, with peaks, for tests, the demo and the estimator.

    Handles are held weakly, so a model dropped while a unit was gathered
    (a forward without backward) does not linger in the counts.
    """

    def __init__(self):
        self.live: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # handle -> bytes
        self.peak_units = self.peak_non_root_units = 0
        self.peak_bytes = 0

    def add(self, handle: "FlatParamHandle"):
        self.live[handle] = handle.padded_bytes
        self.peak_units = max(self.peak_units, len(self.live))
        self.peak_non_root_units = max(self.peak_non_root_units, self.live_non_root)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def remove(self, handle: "FlatParamHandle"):
        self.live.pop(handle, None)

    @property
    def live_non_root(self) -> int:
        return sum(not h.is_root for h in list(self.live))

    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())

    def reset_peaks(self, collect: bool = True):
        """Peaks from now on. ``collect``: first drop units of models that are gone but sit in
        reference cycles (a full gc.collect(), ~0.1 s with torch loaded: not inside a timed step)."""
        if collect:
            gc.collect()
        self.peak_units, self.peak_non_root_units = len(self.live), self.live_non_root
        self.peak_bytes = self.live_bytes


unsharded_tracker = LiveUnshardedTracker()
