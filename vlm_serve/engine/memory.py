"""KV-cache memory: the limit, what a request may come to hold, and what is held now.

One limit (``--kv-cache-memory``) covers the KV of the running batch, of prompts being
prefilled and of cached prefixes. Admission works by reservation: a request is let in
only when the most that every admitted row could ever hold, plus the prefix cache, stays
under the limit; cached prefixes are evicted to make room before anyone waits. What is
held now (the batch's and the caches' ``nbytes``) is reported beside it and never
exceeds what was reserved.

What a row holds comes from the model's own caches (a one-token probe through the
language model): bytes per token of every layer (kv heads, head dim, dtype), the window
of sliding-window layers, the step in which the caches grow. Every row of the batch is
as long as its longest (mlx-lm's batch caches are left-padded to it; the slot store's
columns are shared by all slots), so the batch's bound is its slots x the longest row.
A slot store also allocates slots in buckets and keeps its slots and columns for a
while after rows leave: what it holds now is part of the bound (``Held``).

The limit bounds what is held between steps; a join or a resize of the batch briefly
holds the old arrays beside the new ones.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from ..mlx_runtime import cuda_available

log = logging.getLogger("vlm_serve.engine")

# With no --kv-cache-memory: this share of the device's memory, less the weights. The
# rest is left to activations, the vision tower, the vision-feature cache (bounded on
# its own, --vision-cache-gb) and the system.
DEFAULT_FRACTION = 0.8
# A default that leaves less than this share of the device's memory for KV means the
# weights barely fit; serve anyway with this share rather than none.
MIN_DEFAULT_FRACTION = 0.1
# MLX keeps freed buffers for reuse, by default up to its own memory limit (95% of a
# CUDA GPU). Buffers of shapes the server has stopped using then hold device memory
# that a new shape cannot get. Weights, the KV that admitted requests may come to hold
# and that cache together stay under this share of the device; the rest is for the
# step's temporaries and the backend (see ``BufferCacheBound``).
BUFFER_CACHE_CEILING = 0.9
MIN_BUFFER_CACHE = 1 << 30
# A cache this full of its cap is trimmed to half of it for a turn (see ``BufferCacheBound``).
TRIM_AT = 0.9

_BINARY = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)


class KVBudgetExceeded(ValueError):
    """A request whose KV alone cannot fit the limit, however long it waits."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class MemorySpec:
    """``--kv-cache-memory`` parsed: bytes, or a fraction of the device's memory."""

    bytes: int | None = None
    fraction: float | None = None


def parse_memory(text: str) -> MemorySpec:
    """``8GiB``, ``512MiB``, ``2G`` (binary), ``2GB`` (decimal), ``1073741824`` (bytes),
    or a bare number in (0, 1]: that fraction of the device's memory."""
    match = _SIZE.fullmatch(text or "")
    if not match:
        raise ValueError(f"{text!r} is not a size (e.g. 8GiB, 512MiB) or a fraction (e.g. 0.5)")
    number, prefix, binary, b = match.groups()
    value = float(number)
    if not prefix and not binary and not b and 0 < value <= 1:
        return MemorySpec(fraction=value)
    if binary and not prefix:
        raise ValueError(f"{text!r}: 'i' needs a unit prefix (KiB, MiB, GiB, TiB)")
    scale = 1
    if prefix:
        table = _BINARY if binary or not b else _DECIMAL
        scale = table[prefix.lower()]
    size = int(value * scale)
    if size <= 0:
        raise ValueError(f"{text!r}: must be more than 0")
    return MemorySpec(bytes=size)


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def device_memory() -> tuple[int, str]:
    """The memory MLX may use and where that figure comes from: the GPU's recommended
    working set on Apple Silicon (unified memory, shared with the system), the GPU's
    total on CUDA, the machine's physical memory on the CPU."""
    if mx.metal.is_available() or mx.cuda.is_available():
        info = mx.device_info(mx.gpu)
        for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
            if isinstance(info.get(key), int) and info[key] > 0:
                return info[key], f"GPU {key}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def weights_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def resolve_limit(spec: str | None, model) -> tuple[int, str]:
    """The limit in bytes and how it was found (for the startup log)."""
    total, source = device_memory()
    if spec:
        parsed = parse_memory(spec)
        if parsed.bytes is not None:
            return parsed.bytes, f"--kv-cache-memory {spec}"
        return int(parsed.fraction * total), f"{parsed.fraction:g} of {format_bytes(total)} {source}"
    weights = weights_bytes(model)
    limit = int(DEFAULT_FRACTION * total) - weights
    how = f"{DEFAULT_FRACTION:g} of {format_bytes(total)} {source} less {format_bytes(weights)} of weights"
    if limit < MIN_DEFAULT_FRACTION * total:
        log.warning("the weights (%s) leave little of %s for KV; using %g of it",
                    format_bytes(weights), format_bytes(total), MIN_DEFAULT_FRACTION)
        limit = int(MIN_DEFAULT_FRACTION * total)
        how = f"{MIN_DEFAULT_FRACTION:g} of {format_bytes(total)} {source}"
    return limit, how


class BufferCacheBound:
    """The cap on MLX's cache of freed buffers, moved with the KV that admitted requests
    may come to hold.

    A full cache does not cache: MLX hands each buffer freed while the cache is at its
    cap back to the driver, and each allocation the cache cannot serve goes to the
    driver too. A cache fills with buffers of shapes no one asks for again (a resized
    batch store, each prompt length's temporaries), and the server then allocates from
    the driver for good. With the cap at the room less the whole KV limit (14 GB of an
    H200), a 64-image burst's prefill steps spent 27% of the worker's samples in
    ``cuMemAllocAsync`` and ``cuMemFree`` (py-spy, ``bench/gpu/burst_profile.sh``).

    So, on a CUDA GPU, while requests are admitted, the cap is the room less what they
    reserve (the weights, the reservation and the cache still stay under
    ``BUFFER_CACHE_CEILING``), and a cache that reaches ``TRIM_AT`` of it is trimmed to
    half for a turn (MLX frees the buffers used least recently). An idle server keeps at
    most what the whole KV limit leaves, and lets go of the rest at once. Elsewhere the
    device's memory is the system's too, and the cap stays at that idle one
    (``VLM_SERVE_BUFFER_CACHE``: ``moving`` or ``fixed`` picks either anywhere).
    """

    def __init__(self, kv_limit: int, model, moving: bool | None = None):
        total, _ = device_memory()
        # What the weights leave under the ceiling, for KV and the cache.
        self.room = int(BUFFER_CACHE_CEILING * total) - weights_bytes(model)
        self.idle_cap = max(MIN_BUFFER_CACHE, self.room - kv_limit)
        self.moving = _moving_by_default() if moving is None else moving
        self.cap: int | None = None
        self.trims = 0  # times a full cache was trimmed
        self._set(self.idle_cap)

    def busy(self, kv_reserved: int, trim: bool = True) -> int:
        """Requests are admitted, reserving ``kv_reserved`` bytes: cap the cache at the
        room they leave (half of it for a turn where the cache is nearly that full, if
        ``trim``: once a turn)."""
        if not self.moving:
            return self._set(self.idle_cap)
        cap = max(MIN_BUFFER_CACHE, self.room - kv_reserved)
        if trim and mx.get_cache_memory() >= TRIM_AT * cap:
            cap //= 2
            self.trims += 1
        return self._set(cap)

    def idle(self) -> int:
        """Nothing admitted: keep at most what the whole KV limit leaves."""
        self._set(self.idle_cap)
        if mx.get_cache_memory() > self.idle_cap:
            mx.clear_cache()  # an idle server allocates nothing that would trim it
        return self.idle_cap

    def _set(self, cap: int) -> int:
        if cap != self.cap:
            mx.set_cache_limit(cap)
            self.cap = cap
        return cap


def _moving_by_default() -> bool:
    setting = os.environ.get("VLM_SERVE_BUFFER_CACHE")
    if setting in ("moving", "fixed"):
        return setting == "moving"
    return cuda_available()


def mlx_memory() -> str:
    """What MLX's allocator holds now, for logs: arrays in use, freed buffers it keeps,
    and the peak in use."""
    return (f"mlx_active={format_bytes(mx.get_active_memory())} "
            f"mlx_cache={format_bytes(mx.get_cache_memory())} "
            f"mlx_peak={format_bytes(mx.get_peak_memory())}")


@dataclass(frozen=True)
class LayerKV:
    bytes_per_token: float  # keys and values of one row
    window: int | None  # a sliding-window layer keeps at most this many tokens
    step: int  # the cache grows in steps of this many tokens


@dataclass(frozen=True)
class KVLayout:
    """What one row's caches hold, per layer, from the model's own caches."""

    layers: tuple[LayerKV, ...]
    fixed_bytes: int = 0  # per-row state that does not grow with tokens

    @classmethod
    def probe(cls, language_model) -> "KVLayout":
        """One token through a fresh prompt cache; only shapes are read, so nothing is
        computed (MLX is lazy)."""
        from mlx_vlm.models import cache as vlm_cache

        cache = vlm_cache.make_prompt_cache(language_model)
        language_model(mx.array([[0]], mx.int32), cache=cache)
        layers, fixed = [], 0
        for c in _leaves(cache):
            keys = getattr(c, "keys", None)
            if isinstance(keys, tuple):  # quantized: (weights, scales, biases)
                keys = keys[0]
            if keys is None:
                if not hasattr(c, "keys"):  # not a KV cache: its state is fixed per row
                    fixed += _nbytes(c)
                continue  # a KV layer that stores nothing (shares another layer's KV)
            capacity = keys.shape[2]
            layers.append(LayerKV(
                _nbytes(c) / keys.shape[0] / capacity if capacity else 0.0,
                getattr(c, "max_size", None),
                int(getattr(c, "step", 256) or 1),
            ))
        return cls(tuple(layers), fixed)

    @property
    def bytes_per_token(self) -> float:
        """Per token of context, every layer (sliding-window layers uncapped)."""
        return sum(layer.bytes_per_token for layer in self.layers)

    def cache_bytes(self, tokens: int) -> int:
        """What a cache holding exactly ``tokens`` tokens takes (a sliding-window layer
        at most its window): a prefix-cache entry."""
        total = self.fixed_bytes
        for layer in self.layers:
            total += min(tokens, layer.window or tokens) * layer.bytes_per_token
        return math.ceil(total)

    def row_bytes(self, length: int, held_columns: int = 0) -> int:
        """Most one row of the batch holds while the batch's longest row is ``length``
        tokens long (full layers: up to one allocation step ahead, or the columns the
        batch already holds; sliding-window layers: their window)."""
        total = self.fixed_bytes
        for layer in self.layers:
            tokens = length + layer.step
            if layer.window is not None:
                tokens = min(tokens, layer.window)
            else:
                tokens = max(tokens, held_columns)
            total += tokens * layer.bytes_per_token
        return math.ceil(total)

    def prefill_bytes(self, length: int, chunk: int) -> int:
        """Most a prompt's own cache holds while it is prefilled in chunks of ``chunk``
        tokens (a sliding-window layer grows to its window, or to the window plus the
        chunk just appended)."""
        total = self.fixed_bytes
        for layer in self.layers:
            tokens = length + layer.step
            if layer.window is not None:
                tokens = max(layer.window, min(length, layer.window + chunk))
            total += tokens * layer.bytes_per_token
        return math.ceil(total)

    @property
    def smallest_window(self) -> int | None:
        return min((layer.window for layer in self.layers if layer.window), default=None)

    def describe(self) -> str:
        windows = sorted({layer.window for layer in self.layers if layer.window})
        text = f"{len(self.layers)} KV layers, {format_bytes(self.bytes_per_token)} per token"
        if windows:
            n = sum(1 for layer in self.layers if layer.window)
            text += f" ({n} with a sliding window of {'/'.join(map(str, windows))})"
        return text


@dataclass(frozen=True)
class Held:
    """What the batch has allocated now and keeps while rows live: its slots and the
    columns of its full-attention layers (a slot store's; mlx-lm's caches keep none)."""

    slots: int = 0
    columns: int = 0


@dataclass
class Demand:
    """What a set of admitted requests may come to hold."""

    rows: int = 0  # rows of the batch, now or once their prefill ends
    longest: int = 0  # the longest any of them may grow (prompt + max_tokens)
    prefill: int = 0  # bytes of the prompt caches being prefilled


class KVBudget:
    """The limit, and what a request or a set of them needs under it."""

    def __init__(self, layout: KVLayout, limit: int, chunk: int, text_chunks: bool,
                 short_copies: bool, slots: Callable[[int], int] = lambda rows: rows):
        self.layout = layout
        self.slots = slots  # the slots the batch allocates for this many rows
        self.limit = limit
        self.chunk = max(1, chunk)
        self.text_chunks = text_chunks  # the model prefills text prompts in chunks
        # A prompt that fills a sliding window keeps a copy of its cache one token short
        # for the prefix cache (see Prefill): two caches for a moment.
        self.short_copy_from = layout.smallest_window if short_copies else None
        # prefill_need by prompt length and media: the scheduler sums it over every
        # admitted request whenever it measures its room, and the layout's arithmetic
        # walks every layer (a burst's joins would cost O(requests x layers) each).
        self._prefill_needs: dict[tuple[int, bool], int] = {}

    def add(self, demand: Demand, request, rows: int = 1, prefilling: bool = True) -> None:
        """Count ``rows`` copies of ``request`` into ``demand`` (one shared prefill)."""
        demand.rows += rows
        demand.longest = max(demand.longest, total_tokens(request))
        if prefilling:
            demand.prefill += self.prefill_need(request)

    def prefill_need(self, request) -> int:
        key = (request.num_prompt_tokens, bool(request.has_media))
        need = self._prefill_needs.get(key)
        if need is None:
            p, media = key
            chunk = self.chunk if self.text_chunks and not media else p
            copies = 2 if self.short_copy_from is not None and p >= self.short_copy_from else 1
            need = self.layout.prefill_bytes(p, chunk) * copies
            if len(self._prefill_needs) >= 4096:  # bounded: one entry per prompt length
                self._prefill_needs.clear()
            self._prefill_needs[key] = need
        return need

    def bytes(self, demand: Demand, held: Held = Held()) -> int:
        if not demand.rows:  # an empty batch lets go of everything
            return demand.prefill
        slots = max(held.slots, self.slots(demand.rows))
        return demand.prefill + slots * self.layout.row_bytes(demand.longest, held.columns)

    def alone(self, request, rows: int = 1) -> int:
        """What ``rows`` copies of ``request`` need with nothing else admitted."""
        demand = Demand()
        self.add(demand, request, rows)
        return self.bytes(demand)

    def check(self, request, prompt_param: str = "messages") -> None:
        """Raise ``KVBudgetExceeded`` when ``request`` could never be admitted."""
        need = self.alone(request)
        if need <= self.limit:
            return
        p, m = request.num_prompt_tokens, request.sampling.max_tokens
        param = "max_tokens" if self.fits_tokens(request) >= 1 else prompt_param
        raise KVBudgetExceeded(
            f"the prompt ({p} tokens) + max_tokens ({m}) needs {format_bytes(need)} of KV "
            f"cache, over this server's KV cache memory limit of {format_bytes(self.limit)} "
            f"(--kv-cache-memory)", param)

    def fits_tokens(self, request) -> int:
        """The largest max_tokens with which ``request`` could be admitted (0: none)."""
        p = request.num_prompt_tokens
        lo, hi = 0, max(1, request.sampling.max_tokens)
        while lo < hi:  # the need grows with max_tokens: bisect
            mid = (lo + hi + 1) // 2
            demand = Demand(1, p + mid, self.prefill_need(request))  # alone
            if self.bytes(demand) <= self.limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def copies_per_prefill(self, request, most: int) -> int:
        """How many copies of ``request`` (n > 1) can share one prefill: as many as
        could run together at all, up to ``most``."""
        k = most
        while k > 1 and self.alone(request, k) > self.limit:
            k -= 1
        return k


def total_tokens(request) -> int:
    return request.num_prompt_tokens + request.sampling.max_tokens


def cache_bytes(cache) -> int:
    """Bytes held by a list of layer caches (None: none)."""
    return sum(_nbytes(c) for c in cache) if cache else 0


def _leaves(cache):
    for c in cache:
        inner = getattr(c, "caches", None)
        if isinstance(inner, (list, tuple)):
            yield from _leaves(inner)
        else:
            yield c


def _nbytes(c) -> int:
    try:
        return int(c.nbytes)
    except (AttributeError, NotImplementedError):
        return 0
