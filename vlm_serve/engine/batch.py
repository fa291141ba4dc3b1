"""The running batch: one batched decode step for every row.

Rows that finished prefill join with their own single-request caches, merged into
left-padded batch caches (``BatchKVCache`` / ``BatchRotatingKVCache``, one per layer, the
design of mlx-lm's, as mlx-vlm's cache module provides them). Rows that finish leave at
once: the caches are filtered. A family that is not batched (``Family.batched``) has at
most one row, which keeps its own prompt cache, exactly as in single-request generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .families import Family
from .sampling import BatchSampler, SampleOutput


@dataclass
class JoiningRow:
    """A request that finished prefill: its own cache, its one-row sampler, its first
    token (a lazy (1,) array: the next step is queued before anyone reads it)."""

    cache: list
    sampler: BatchSampler
    first_token: mx.array
    state: dict[str, Any]


class Batch:
    def __init__(self, model, family: Family, vocab_size: int):
        self.model = model
        self.family = family
        self.vocab_size = vocab_size
        self.row_states: list[dict[str, Any]] = []
        self.cache: list | None = None
        self.sampler = BatchSampler(vocab_size)
        # The input of the next step: one token per row, possibly still being computed
        # by the step in flight (so the next step can be queued before it finishes).
        self.next_tokens: mx.array | None = None

    def __len__(self) -> int:
        return len(self.row_states)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache) if self.cache else 0

    def add(self, rows: list[JoiningRow]) -> None:
        """Append prefilled rows. They are merged among themselves first (KVCache.merge /
        RotatingKVCache.merge build the matching batch caches), so the running batch's
        caches are copied once per join, not once per row."""
        if not rows:
            return
        if not self.family.batched:
            if self.cache is not None or len(rows) > 1:
                raise RuntimeError(f"{self.family.describe()}: cannot batch rows")
            self.cache = rows[0].cache
        elif self.cache is None:
            self.cache = self._merged(rows)
        else:
            joining = self._merged(rows)
            for mine, theirs in zip(self.cache, joining):
                mine.extend(theirs)
        firsts = [row.first_token.astype(mx.int32).reshape(1) for row in rows]
        if self.next_tokens is not None:
            firsts.insert(0, self.next_tokens)
        self.next_tokens = mx.concatenate(firsts)
        for row in rows:
            self.sampler.extend(row.sampler)
            self.row_states.append(row.state)

    @staticmethod
    def _merged(rows: list[JoiningRow]) -> list:
        return [type(layer[0]).merge(list(layer)) for layer in zip(*(row.cache for row in rows))]

    def keep(self, indices: list[int]) -> None:
        """Keep the rows at ``indices``; everything else leaves the batch now."""
        if len(indices) == len(self):
            return
        if not indices:
            self.reset()
            return
        idx = mx.array(indices, mx.int32)
        for c in self.cache:
            c.filter(idx)
        self.sampler.keep(indices)
        self.row_states = [self.row_states[i] for i in indices]
        self.next_tokens = self.next_tokens[idx]

    def reset(self) -> None:
        self.cache = None
        self.sampler = BatchSampler(self.vocab_size)
        self.row_states = []
        self.next_tokens = None

    def step(self, allowed: mx.array | None = None) -> SampleOutput:
        """Queue one decode step for all rows. Nothing is evaluated here: the returned
        tokens are lazy and already feed the step after this one. ``allowed`` masks the
        tokens of rows under a grammar."""
        kwargs = self.family.decode_kwargs(self.cache, self.row_states)
        out = self.model.language_model(self.next_tokens[:, None], cache=self.cache, **kwargs)
        self.family.after_step(out, self.row_states)
        sample = self.sampler.sample(out.logits[:, -1, :], allowed)
        self.next_tokens = sample.tokens
        return sample
