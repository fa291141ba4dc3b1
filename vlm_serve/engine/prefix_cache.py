"""Reuse of earlier prompts' KV for prompts that share a prefix.

Built on mlx-lm's ``LRUPromptCache`` (a token trie that trims a longer cached prompt
down to the shared prefix where the cache allows it). Identical token ids with
different images must never share KV (the image placeholders are the same tokens), so
in the key every image placeholder becomes a mark derived from the digests of all the
request's images, in order: the same conversation with the same images matches, while
another image, or the same images in another order, diverges at the first placeholder
(the text before it, which cannot see the image, still matches).

Eviction is least recently used first and is done here, not by mlx-lm, so that it is
counted and so that the memory budget can shrink the cache (``evict_to``) and bound
what a new entry may take (``room``). mlx-lm orders entries by insertion only, so a hit
moves its entry to the back (a shared system prompt stays while it is in use).
"""

from __future__ import annotations

import copy
import hashlib
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from .memory import cache_bytes

_MODEL_KEY = "served-model"
_UNBOUNDED = 1 << 62


def prefix_key(tokens: list[int], image_tokens: frozenset, digests: tuple[str, ...]) -> list[int]:
    """The cache key of a prompt: its token ids, image placeholders marked by images."""
    if not digests:
        return tokens
    digest = hashlib.sha256("|".join(digests).encode()).hexdigest()
    mark = -1 - int(digest[:15], 16)  # negative: never a real token id
    return [mark if t in image_tokens else t for t in tokens]


class PrefixCache:
    def __init__(self, max_entries: int, max_bytes: int, room: Callable[[], int] | None = None,
                 min_reuse: int = 1):
        self._lru = LRUPromptCache(max_size=_UNBOUNDED, max_bytes=_UNBOUNDED)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # A stored prefix shorter than this is prefilled again, not copied (on a GPU the
        # copy costs the worker more than the tokens' prefill: server.default_prefix_min_tokens).
        self.min_reuse = max(1, min_reuse)
        # The bytes cached prefixes may hold now, beside everything else under the
        # memory budget (None: only max_bytes).
        self.room = room
        self.queried_tokens = 0  # prompt tokens looked up
        self.reused_tokens = 0  # ... whose KV was found here
        self.evictions = 0  # entries dropped to make room

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def lookup(self, tokens: list[int], at_most: int | None = None) -> tuple[list | None, int]:
        """A copy of the cache of the longest stored prefix of ``tokens`` (of at most
        ``at_most`` tokens where given, of at least ``min_reuse``) and its length. At
        least one token is always left to prefill (it gives the first logits)."""
        self.queried_tokens += len(tokens)
        key, stored, reused = self._choose(tokens, at_most)
        if key is None:
            return None, 0
        cache = copy.deepcopy(stored)
        if reused < len(key):
            trim_prompt_cache(cache, len(key) - reused)
        # Used now: the entry goes to the back of the eviction order.
        self._lru._lru.remove(_MODEL_KEY, key)
        self._lru._lru.push(_MODEL_KEY, key)
        _compact(cache)
        self.reused_tokens += reused
        return cache, reused

    def reusable(self, tokens: list[int], at_most: int | None = None) -> int:
        """How many tokens ``lookup`` would reuse, found without copying anything."""
        return self._choose(tokens, at_most)[2]

    def _choose(self, tokens: list[int], at_most: int | None) -> tuple[list[int] | None, list | None, int]:
        """The stored prompt ``lookup`` starts from, its cache (not a copy) and how many
        of its tokens it reuses."""
        if at_most is not None:
            tokens = tokens[:at_most + 1]
        key, reused = self._nearest(tokens)
        reused = min(reused, len(tokens) - 1)  # the last token gives the first logits
        if key is None or reused < self.min_reuse:
            return None, None, 0
        stored = self._lru._trie.get(_MODEL_KEY, key).prompt_cache
        if reused < len(key) and not can_trim_prompt_cache(stored):
            return None, None, 0  # a longer prompt whose window has wrapped cannot be cut back
        return key, stored, reused

    def _nearest(self, tokens: list[int]) -> tuple[list[int] | None, int]:
        """The stored prompt to start ``tokens`` from, and how many of its tokens they
        share; mlx-lm's ``fetch_nearest_cache`` choice: the same prompt, else the stored
        prompt sharing the most that can be trimmed back to what it shares (the
        shortest such), else the longest stored prefix. Its trie search walks every
        longer entry copying paths (quadratic in the prompt length: 9% of the worker at
        64 concurrent ~800-token prompts); with at most ``max_entries`` entries, one
        comparison per entry is cheap."""
        keys = [k for lru in self._lru._lru._lrus.values() for _, k in lru]
        shared = [(_common_prefix(k, tokens), k) for k in keys]
        exact = next((k for n, k in shared if n == len(k) == len(tokens)), None)
        if exact is not None:
            return exact, len(exact)
        prefixes = [k for n, k in shared if n == len(k)]
        shorter = max(prefixes, key=len) if prefixes else None
        most = max((n for n, _ in shared), default=0)
        if most > (len(shorter) if shorter else 0):
            longer = min((k for n, k in shared if n == most and len(k) > n), key=len, default=None)
            if longer is not None and can_trim_prompt_cache(self._lru._trie.get(_MODEL_KEY, longer).prompt_cache):
                return longer, most
        return (shorter, len(shorter)) if shorter else (None, 0)

    def store(self, tokens: list[int], cache: list) -> None:
        """Keep ``cache`` (which holds exactly ``tokens``); the caller must not update it
        afterwards (rows join the batch by copy, so a finished prefill's cache is free).
        An entry larger than the room the budget leaves is not kept; older entries are
        evicted to make room for one that fits."""
        room = self._room()  # measures the admitted requests' demand: once
        if not self.fits(cache_bytes(cache), room):
            return
        self._lru.insert_cache(_MODEL_KEY, list(tokens), cache)
        self.evict_to(room)

    def fits(self, nbytes: int, room: int | None = None) -> bool:
        """Whether an entry of ``nbytes`` would be kept (see ``store``), ``room`` being
        what cached prefixes may hold now (measured where not given)."""
        return self.max_entries > 0 and nbytes <= (self._room() if room is None else room)

    def _room(self) -> int:
        return min(self.max_bytes, self.room() if self.room else _UNBOUNDED)

    def evict_to(self, max_bytes: int) -> None:
        """Evict the least recently stored entries until the cache holds at most
        ``max_bytes`` and ``max_entries``."""
        while len(self) and (self.nbytes > max_bytes or len(self) > self.max_entries):
            self._lru.trim_to(n_sequences=len(self) - 1)
            self.evictions += 1


def _compact(cache: list) -> None:
    """A cache trimmed down from a longer prompt still holds that prompt's buffers:
    keep only what is used (a window only while it has not wrapped). The new prompt's
    cache is then the size of its own, and prompts that start from the same prefix
    have caches of one shape, whichever stored prompt they came from, so they can share
    their prefill passes."""
    for c in cache:
        keys = getattr(c, "keys", None)
        offset = getattr(c, "offset", None)
        if not isinstance(keys, mx.array) or not isinstance(offset, int):
            continue
        window = getattr(c, "max_size", None)
        unwrapped = window is None or (offset < window and getattr(c, "_idx", None) == offset)
        if unwrapped and keys.shape[2] > offset:
            c.keys = mx.contiguous(keys[..., :offset, :])
            c.values = mx.contiguous(c.values[..., :offset, :])


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (bisection on list slices, which
    compare in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low
