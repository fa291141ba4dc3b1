"""A least-recently-used store bounded by entries and by bytes, shared by the caches
that keep large values (decoded images, vision features)."""

from __future__ import annotations

import threading
from collections import OrderedDict


class SizedLRU:
    """A thread-safe LRU of values with a size each. Adding past either bound evicts the
    least recently used entries first; a value larger than ``max_bytes`` is not kept (it
    would evict everything and then itself)."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[object, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key):
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key, value, nbytes: int) -> None:
        if self.max_entries <= 0 or nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (value, nbytes)
            self.bytes += nbytes
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self.bytes -= size
                self.evictions += 1
