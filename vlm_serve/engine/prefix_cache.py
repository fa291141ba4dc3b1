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
    def __init__(self, max_entries: int, max_bytes: int, room: Callable[[], int] | None = None):
        self._lru = LRUPromptCache(max_size=_UNBOUNDED, max_bytes=_UNBOUNDED)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
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

    def lookup(self, tokens: list[int]) -> tuple[list | None, int]:
        """A copy of the cache of the longest stored prefix of ``tokens`` and its length.
        At least one token is always left to prefill (it gives the first logits)."""
        self.queried_tokens += len(tokens)
        cache, rest = self._lru.fetch_nearest_cache(_MODEL_KEY, tokens)
        if cache is None:
            return None, 0
        self._touch(tokens)
        reused = len(tokens) - len(rest)
        if reused == len(tokens):
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            reused -= 1
        if reused <= 0:
            return None, 0
        _compact(cache)
        self.reused_tokens += reused
        return cache, reused

    def store(self, tokens: list[int], cache: list) -> None:
        """Keep ``cache`` (which holds exactly ``tokens``); the caller must not update it
        afterwards (rows join the batch by copy, so a finished prefill's cache is free).
        An entry larger than the room the budget leaves is not kept; older entries are
        evicted to make room for one that fits."""
        room = min(self.max_bytes, self.room() if self.room else _UNBOUNDED)
        if self.max_entries <= 0 or cache_bytes(cache) > room:
            return
        self._lru.insert_cache(_MODEL_KEY, list(tokens), cache)
        self.evict_to(room)

    def _touch(self, tokens: list[int]) -> None:
        """Make the entry that ``fetch_nearest_cache`` just used the most recently used
        (the same choice of entry as it makes; mlx-lm internals, so never fatal)."""
        try:
            found = self._lru._trie.search(_MODEL_KEY, tokens)
            key = found.exact
            short = len(found.shorter) if found.shorter is not None else 0
            if key is None and found.longer is not None and found.common_prefix > short:
                entry = self._lru._trie.get(_MODEL_KEY, found.longer)
                if can_trim_prompt_cache(entry.prompt_cache):
                    key = found.longer
            if key is None:
                key = found.shorter
            if key:
                self._lru._lru.remove(_MODEL_KEY, key)
                self._lru._lru.push(_MODEL_KEY, key)
        except Exception:  # noqa: BLE001 - only the eviction order is at stake
            pass

    def evict_to(self, max_bytes: int) -> None:
        """Evict the least recently stored entries until the cache holds at most
        ``max_bytes`` and ``max_entries``."""
        while len(self) and (self.nbytes > max_bytes or len(self) > self.max_entries):
            self._lru.trim_to(n_sequences=len(self) - 1)
            self.evictions += 1


def _compact(cache: list) -> None:
    """A cache trimmed down from a longer prompt still holds that prompt's buffers:
    keep only what is used, so the new prompt's cache is the size of its own (a step
    of slack is what the cache would allocate anyway)."""
    for c in cache:
        keys = getattr(c, "keys", None)
        if (
            isinstance(keys, mx.array) and getattr(c, "max_size", None) is None
            and isinstance(getattr(c, "offset", None), int)
            and keys.shape[2] - c.offset >= getattr(c, "step", 256)
        ):
            c.keys = mx.contiguous(keys[..., : c.offset, :])
            c.values = mx.contiguous(c.values[..., : c.offset, :])
