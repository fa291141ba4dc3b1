"""Projected image features of recent requests, so a conversation that sends the same
image every turn runs the vision tower once."""

from __future__ import annotations

from collections import OrderedDict


class VisionCache:
    """Features keyed by the request's image digests, least recently used out first.
    A family may store any value its encoder returns (an array, or a tuple of them)."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[tuple, object] = OrderedDict()
        self.hits = 0

    def get(self, key: tuple):
        features = self._entries.get(key)
        if features is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return features

    def put(self, key: tuple, features) -> None:
        if self.size <= 0:
            return
        self._entries[key] = features
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
