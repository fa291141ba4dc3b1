"""Vectorised per-row sampling for a batch of running requests.

Every row has its own settings (temperature, top-p/k, min-p, penalties, logit bias,
seed), held as arrays so one step samples all rows with a handful of MLX ops, however
many rows there are and whichever of them carry a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .types import SamplingParams

LOGPROB_FLOOR = -9999.0
_MASK64 = (1 << 64) - 1


def _row_key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit words that depend only on (seed, position) (splitmix64): a seeded
    request samples the same tokens whether it runs alone or next to other rows."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & 0xFFFFFFFF, z >> 32


def _mix32(h: mx.array) -> mx.array:
    # MurmurHash3's finalizer on uint32 (multiplication wraps).
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@mx.compile
def _keyed_gumbel(keys: mx.array, vocab: mx.array) -> mx.array:
    """Gumbel noise (B, V) from a counter-based hash of each row's key (B, 2) uint32
    and the token id: one fused computation for the whole batch."""
    h = _mix32(_mix32(vocab ^ keys[:, :1]) + keys[:, 1:])
    u = ((h >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -mx.log(-mx.log(u))


@dataclass
class SampleOutput:
    tokens: mx.array  # (B,) int32
    logprobs: mx.array  # (B, V) float32, normalised, after penalties and bias


class BatchSampler:
    """Holds the sampling state of the rows of a batch, in batch order."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.params: list[SamplingParams] = []
        self.positions: list[int] = []  # tokens sampled so far, per row
        self._arrays: dict[str, mx.array] | None = None
        self._bias: mx.array | None = None  # (B, V) or None when no row has a bias
        self._counts: mx.array | None = None  # (B, V) generated-token counts
        self._seen: mx.array | None = None  # (B, V) prompt or generated, for repetition
        # min_tokens: the tokens each row may not end on yet, and how many more tokens
        # it must generate before it may; None while no row asks for a minimum.
        self._banned: mx.array | None = None  # (B, V) bool
        self._min_left: mx.array | None = None  # (B,) int32

    def __len__(self) -> int:
        return len(self.params)

    # -- membership -------------------------------------------------------------------

    def add(self, params: SamplingParams, prompt_ids: list[int], eos_ids=()) -> None:
        """Append a row; ``eos_ids`` are the model's end tokens, banned with the row's
        stop token ids until ``params.min_tokens`` tokens are generated."""
        V = self.vocab_size
        B = len(self.params)
        self.params.append(params)
        self.positions.append(0)
        self._arrays = None

        if params.logit_bias or self._bias is not None:
            row = mx.zeros((1, V), mx.float32)
            if params.logit_bias:
                ids = mx.array(list(params.logit_bias.keys()), mx.int32)
                vals = mx.array(list(params.logit_bias.values()), mx.float32)
                row = row.at[0, ids].add(vals)
            old = self._bias if self._bias is not None else mx.zeros((B, V), mx.float32)
            self._bias = mx.concatenate([old, row])

        if params.needs_penalties or self._counts is not None:
            counts = mx.zeros((1, V), mx.float32)
            seen = mx.zeros((1, V), mx.bool_)
            # Image placeholders may lie outside the logits' range (Phi-3.5-vision's
            # negative ids, Llama 3.2 Vision's <|image|> past the LM head): not tokens.
            prompt_ids = [i for i in prompt_ids if 0 <= i < V]
            if params.repetition_penalty != 1.0 and prompt_ids:
                seen = seen.at[0, mx.array(prompt_ids, mx.int32)].add(True)
            if self._counts is None:
                self._counts = mx.zeros((B, V), mx.float32)
                self._seen = mx.zeros((B, V), mx.bool_)
            self._counts = mx.concatenate([self._counts, counts])
            self._seen = mx.concatenate([self._seen, seen])

        if params.min_tokens > 0 or self._banned is not None:
            ends = [*(() if params.ignore_eos else eos_ids), *params.stop_token_ids]
            ends = [t for t in ends if 0 <= t < V]
            banned = mx.zeros((1, V), mx.bool_)
            if params.min_tokens > 0 and ends:
                banned = banned.at[0, mx.array(ends, mx.int32)].add(True)
            if self._banned is None:
                self._banned = mx.zeros((B, V), mx.bool_)
                self._min_left = mx.zeros((B,), mx.int32)
            self._banned = mx.concatenate([self._banned, banned])
            self._min_left = mx.concatenate([self._min_left, mx.array([params.min_tokens], mx.int32)])

    def extend(self, other: "BatchSampler") -> None:
        """Append the rows of ``other`` (e.g. a row that just finished prefill)."""
        B, Bo, V = len(self), len(other), self.vocab_size

        def cat(mine, theirs, dtype, width=(V,)):
            if mine is None and theirs is None:
                return None
            mine = mine if mine is not None else mx.zeros((B, *width), dtype)
            theirs = theirs if theirs is not None else mx.zeros((Bo, *width), dtype)
            return mx.concatenate([mine, theirs])

        self._bias = cat(self._bias, other._bias, mx.float32)
        self._counts = cat(self._counts, other._counts, mx.float32)
        self._seen = cat(self._seen, other._seen, mx.bool_)
        self._banned = cat(self._banned, other._banned, mx.bool_)
        self._min_left = cat(self._min_left, other._min_left, mx.int32, ())
        self.params += other.params
        self.positions += other.positions
        self._arrays = None

    def keep(self, indices: list[int]) -> None:
        """Keep only the rows at ``indices`` (in that order)."""
        self.params = [self.params[i] for i in indices]
        self.positions = [self.positions[i] for i in indices]
        self._arrays = None
        if not indices:
            self._bias = self._counts = self._seen = self._banned = self._min_left = None
            return
        idx = mx.array(indices, mx.int32)
        if self._bias is not None:
            self._bias = self._bias[idx]
        if self._counts is not None:
            self._counts = self._counts[idx]
            self._seen = self._seen[idx]
        if self._banned is not None and not any(p.min_tokens > 0 for p in self.params):
            self._banned = self._min_left = None
        elif self._banned is not None:
            self._banned = self._banned[idx]
            self._min_left = self._min_left[idx]

    # -- sampling ---------------------------------------------------------------------

    def _param_arrays(self) -> dict[str, mx.array]:
        if self._arrays is None:
            ps = self.params
            V = self.vocab_size
            self._arrays = {
                "temperature": mx.array([max(p.temperature, 0.0) for p in ps], mx.float32),
                "top_p": mx.array([p.top_p for p in ps], mx.float32),
                "top_k": mx.array([p.top_k if p.top_k > 0 else V for p in ps], mx.int32),
                "min_p": mx.array([p.min_p for p in ps], mx.float32),
                "repetition": mx.array([p.repetition_penalty for p in ps], mx.float32),
                "presence": mx.array([p.presence_penalty for p in ps], mx.float32),
                "frequency": mx.array([p.frequency_penalty for p in ps], mx.float32),
            }
        return self._arrays

    def _apply_penalties(self, logits: mx.array, a: dict[str, mx.array]) -> mx.array:
        rep = a["repetition"][:, None]
        penalised = mx.where(logits > 0, logits / rep, logits * rep)
        logits = mx.where(self._seen, penalised, logits)
        logits = logits - a["frequency"][:, None] * self._counts
        return logits - a["presence"][:, None] * (self._counts > 0)

    def _noise(self, shape: tuple[int, int]) -> mx.array:
        seeded = [p.seed is not None for p in self.params]
        if not any(seeded):
            return mx.random.gumbel(shape)
        keys = mx.array(
            [_row_key(p.seed, n) if p.seed is not None else (0, 0)
             for p, n in zip(self.params, self.positions)],
            mx.uint32,
        )
        if not all(seeded):  # the other rows draw their keys from MLX's generator
            drawn = mx.random.randint(0, 1 << 31, (shape[0], 2)).astype(mx.uint32)
            keys = mx.where(mx.array(seeded)[:, None], keys, drawn)
        return _keyed_gumbel(keys, mx.arange(shape[1], dtype=mx.uint32)[None, :])

    def sample(self, logits: mx.array, allowed: mx.array | None = None) -> SampleOutput:
        """Sample one token per row from ``logits`` of shape (B, V); ``allowed`` (B, V)
        restricts rows to the tokens their grammar permits."""
        a = self._param_arrays()
        logits = logits.astype(mx.float32)
        if allowed is not None:
            logits = mx.where(allowed, logits, -mx.inf)
        if self._counts is not None:
            logits = self._apply_penalties(logits, a)
        if self._bias is not None:
            logits = logits + self._bias
        if self._banned is not None:  # after the bias: no bias lets a row end early
            logits = mx.where(self._banned & (self._min_left > 0)[:, None], -mx.inf, logits)
            self._min_left = mx.maximum(self._min_left - 1, 0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1).astype(mx.int32)

        if any(not p.is_greedy for p in self.params):
            tokens = mx.where(a["temperature"] > 0, self._sample_random(logprobs, a), tokens)

        if self._counts is not None:
            rows = mx.arange(len(self.params))
            self._counts = self._counts.at[rows, tokens].add(1.0)
            self._seen = self._seen.at[rows, tokens].add(True)
        self.positions = [n + 1 for n in self.positions]
        return SampleOutput(tokens=tokens, logprobs=logprobs)

    def _sample_random(self, logprobs: mx.array, a: dict[str, mx.array]) -> mx.array:
        temp = mx.where(a["temperature"] > 0, a["temperature"], 1.0)[:, None]
        scaled = logprobs / temp
        noise = self._noise(scaled.shape)
        truncating = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in self.params)
        if not truncating:
            # Gumbel-max: argmax(logits + Gumbel noise) is a categorical sample.
            return mx.argmax(scaled + noise, axis=-1).astype(mx.int32)

        # Find each row's cut-off in sorted order, then mask in vocabulary order so the
        # noise lines up with token ids whatever the other rows ask for.
        order = mx.argsort(-scaled, axis=-1)
        sorted_lp = mx.take_along_axis(scaled, order, axis=-1)
        probs = mx.softmax(sorted_lp, axis=-1)
        rank = mx.arange(scaled.shape[1])[None, :]
        top_p = a["top_p"][:, None]
        keep = rank < a["top_k"][:, None]
        keep = keep & (((mx.cumsum(probs, axis=-1) - probs) < top_p) | (top_p >= 1.0))
        keep = keep & (probs >= a["min_p"][:, None] * probs[:, :1])
        threshold = mx.min(mx.where(keep, sorted_lp, mx.inf), axis=-1, keepdims=True)
        masked = mx.where(scaled >= threshold, scaled, -mx.inf)
        return mx.argmax(masked + noise, axis=-1).astype(mx.int32)


def top_logprobs(logprobs: mx.array, tokens: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """Chosen-token logprob plus the k best (ids, values) per row, best first. Values
    are floored at -9999 (OpenAI's convention): masked tokens are -inf, not JSON."""
    chosen = _floor(mx.take_along_axis(logprobs, tokens[:, None], axis=-1).squeeze(-1))
    if k <= 0:
        empty = mx.zeros((logprobs.shape[0], 0))
        return chosen, empty.astype(mx.int32), empty
    ids = mx.argsort(-logprobs, axis=-1)[:, :k]
    return chosen, ids, _floor(mx.take_along_axis(logprobs, ids, axis=-1))


def _floor(x: mx.array) -> mx.array:
    # The comparison is False for NaN too, so NaN also becomes the floor.
    return mx.where(x >= LOGPROB_FLOOR, x, LOGPROB_FLOOR)
