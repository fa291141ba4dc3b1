"""Projected image features of recent requests, so a conversation that sends the same
image every turn runs the vision tower once."""

from __future__ import annotations

from mlx.utils import tree_flatten

from ..lru import SizedLRU

# The byte bound when none is given (--vision-cache-gb's default).
DEFAULT_MAX_BYTES = 1 << 30


class VisionCache(SizedLRU):
    """Features keyed by the request's image digests, least recently used out first,
    bounded by entries (``--vision-cache-size``) and by the bytes of their arrays
    (``--vision-cache-gb``). A family may store any value its encoder returns (an
    array, or a tuple of them)."""

    def __init__(self, size: int, max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__(size, max_bytes)

    @property
    def size(self) -> int:
        return self.max_entries

    def put(self, key: tuple, features) -> None:  # sized by its arrays
        super().put(key, features, features_bytes(features))


def features_bytes(features) -> int:
    """Bytes of the arrays in a family's features (known from shapes, so nothing is
    computed)."""
    return sum(int(getattr(v, "nbytes", 0)) for _, v in tree_flatten(features))
