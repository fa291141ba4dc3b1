"""Reuse of earlier prompts' KV for prompts that share a prefix.

Built on mlx-lm's ``LRUPromptCache`` (a token trie with LRU eviction that trims a
longer cached prompt down to the shared prefix where the cache allows it). Identical
token ids with different images must never share KV (the image placeholders are the
same tokens), so in the key every image placeholder becomes a mark derived from the
digests of all the request's images, in order: the same conversation with the same
images matches, while another image, or the same images in another order, diverges
at the first placeholder (the text before it, which cannot see the image, still
matches).
"""

from __future__ import annotations

import hashlib

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

_MODEL_KEY = "served-model"


def prefix_key(tokens: list[int], image_tokens: frozenset, digests: tuple[str, ...]) -> list[int]:
    """The cache key of a prompt: its token ids, image placeholders marked by images."""
    if not digests:
        return tokens
    digest = hashlib.sha256("|".join(digests).encode()).hexdigest()
    mark = -1 - int(digest[:15], 16)  # negative: never a real token id
    return [mark if t in image_tokens else t for t in tokens]


class PrefixCache:
    def __init__(self, max_entries: int, max_bytes: int):
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self.reused_tokens = 0

    def lookup(self, tokens: list[int]) -> tuple[list | None, int]:
        """A copy of the cache of the longest stored prefix of ``tokens`` and its length.
        At least one token is always left to prefill (it gives the first logits)."""
        cache, rest = self._lru.fetch_nearest_cache(_MODEL_KEY, tokens)
        if cache is None:
            return None, 0
        reused = len(tokens) - len(rest)
        if reused == len(tokens):
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            reused -= 1
        if reused <= 0:
            return None, 0
        self.reused_tokens += reused
        return cache, reused

    def store(self, tokens: list[int], cache: list) -> None:
        """Keep ``cache`` (which holds exactly ``tokens``); the caller must not update it
        afterwards (rows join the batch by copy, so a finished prefill's cache is free)."""
        self._lru.insert_cache(_MODEL_KEY, list(tokens), cache)
