"""The running batch: one batched decode step for every row.

Rows that finished prefill join with their own single-request caches. Where the family
has an engine-owned decode step (``Family.decoder``), the rows are copied into its slot
store and decode through it. Otherwise they are merged into left-padded batch caches
(``BatchKVCache`` / ``BatchRotatingKVCache``, one per layer, the design of mlx-lm's, as
mlx-vlm's cache module provides them) and decode through mlx-vlm's model code. Rows that
finish leave at once. A family that is not batched (``Family.batched``) has at most one
row, which keeps its own prompt cache, exactly as in single-request generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_vlm.models import cache as vlm_cache

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
        self.decoder = family.decoder() if family.batched else None
        self.store = self.decoder.new_store() if self.decoder else None
        self.sampler = BatchSampler(vocab_size)
        # The input of the next step: one token per row, possibly still being computed
        # by the step in flight (so the next step can be queued before it finishes).
        self.next_tokens: mx.array | None = None

    def __len__(self) -> int:
        return len(self.row_states)

    @property
    def nbytes(self) -> int:
        if self.store is not None:
            return self.store.nbytes
        return sum(c.nbytes for c in self.cache) if self.cache else 0

    def add(self, rows: list[JoiningRow]) -> None:
        """Append prefilled rows: copied into free slots of the store, or, on the batch
        caches, merged among themselves first (KVCache.merge / RotatingKVCache.merge
        build the matching batch caches) so the running batch's caches are copied once
        per join, not once per row."""
        if not rows:
            return
        if self.store is not None:
            self.store.join(
                [row.cache for row in rows], [self.family.rope_shift(row.state) for row in rows]
            )
        elif not self.family.batched:
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
        """Keep the rows at ``indices`` (ascending), in their order; everything else
        leaves the batch now."""
        if len(indices) == len(self):
            return
        if not indices:
            self.reset()
            return
        idx = mx.array(indices, mx.int32)
        if self.store is not None:
            self.store.keep(indices)
        else:
            for c in self.cache:
                c.filter(idx)
        self.sampler.keep(indices)
        self.row_states = [self.row_states[i] for i in indices]
        self.next_tokens = self.next_tokens[idx]

    def row_cache(self, index: int) -> list | None:
        """Row ``index``'s KV now (its prompt and the tokens it has decoded), as the
        single-request caches a prompt's prefill leaves: copies, queued on the device,
        that stay valid after the row leaves. None where its caches cannot be split off."""
        if self.store is not None:
            caches = vlm_cache.make_prompt_cache(self.model.language_model)
            self.store.fill_row_cache(index, caches)
        elif self.family.batched and all(hasattr(c, "extract") for c in self.cache):
            caches = [c.extract(index) for c in self.cache]  # mlx-vlm's batch caches
        else:
            return None
        mx.async_eval([c.state for c in caches])
        return caches

    def reset(self) -> None:
        self.cache = None
        if self.store is not None:
            self.store.reset()
        self.sampler = BatchSampler(self.vocab_size)
        self.row_states = []
        self.next_tokens = None

    def step(self, allowed: mx.array | None = None) -> SampleOutput:
        """Queue one decode step for all rows. Nothing is evaluated here: the returned
        tokens are lazy and already feed the step after this one. ``allowed`` masks the
        tokens of rows under a grammar."""
        sample = self.sampler.sample(self._logits(), allowed)
        self.next_tokens = sample.tokens
        return sample

    def _logits(self) -> mx.array:
        """Last-position logits (rows, vocab) of one decode step."""
        if self.store is not None:
            rows, slots = len(self), self.store.slots
            tokens, where = self.next_tokens, self.store.slot_order()
            if where is not None:  # rows in other slots: each token to its row's slot
                tokens = mx.zeros((slots,), mx.int32).at[where].add(tokens)
            elif slots > rows:  # the free slots of the store's bucket decode a dummy token
                tokens = mx.concatenate([tokens, mx.zeros((slots - rows,), mx.int32)])
            logits = self.decoder(tokens, self.store)
            if where is not None:
                return mx.take(logits, where, axis=0)
            return logits[:rows] if slots > rows else logits
        kwargs = self.family.decode_kwargs(self.cache, self.row_states)
        out = self.model.language_model(self.next_tokens[:, None], cache=self.cache, **kwargs)
        self.family.after_step(out, self.row_states)
        return out.logits[:, -1, :]
