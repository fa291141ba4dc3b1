"""What every engine decode step shares: the slot store's bookkeeping around a pure
forward function of the step's arrays, optionally compiled.

``forward(tokens, positions, write_indices, visible, keys, values, *inputs)`` takes
everything as arrays (the store's per-kind write indices and visible keys, a mask or
counts as ``attention.attend`` takes them; its per-layer keys and values; and whatever
further per-row arrays a decoder's ``step_inputs`` makes) and returns the logits and
the updated keys and values, so it can be handed to ``mx.compile``: the graph is then
traced once per shape and replayed from C++ instead of being rebuilt op by op in Python
every step.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx

from . import cuda_attention
from .attention import uses_kernels
from .store import LayerKind, SlotStore

log = logging.getLogger("vlm_serve.engine")

# Set VLM_SERVE_COMPILE_DECODE=0 to build the step op by op (for comparison).
COMPILE = os.environ.get("VLM_SERVE_COMPILE_DECODE", "1") != "0"
# On CUDA, past this many slots the step is built op by op. Measured on H100s,
# Gemma-3-4B shape: before the step's shapes stopped following the span, op by op was
# faster at 128 slots (11.8 vs 14.3 and 14.0 vs 17.6 ms; bench/results/
# gpu-h100-cuda-attention); since then, compiled was faster at 128 in two runs of three
# (15.5 vs 17.9, 16.6 vs 17.8, 15.8 vs 15.2 ms) but far slower at 96 in both runs that
# timed it (18.6 vs 12.1 and 16.8 vs 10.6 ms; bench/results/gpu-bucketed-passes), and
# even at 64. On an H200 the two were within 0.8 ms of each other at 64, 96 and 128
# slots, in either order (bench/results/gpu-h200-compile-limit). Op by op may round
# differently from compiled (Gemma 4's step does, on an H200), and a row must get the
# same bits whatever the slots: so the first step past the limit runs both ways, and
# where they differ the step stays compiled.
CUDA_COMPILE_MAX_SLOTS = int(os.environ.get("VLM_SERVE_CUDA_COMPILE_MAX_SLOTS", "64"))


class StepDecoder:
    # Whether batched rows of this step have been seen to keep their bits alone on CUDA;
    # a step that has not is served one row at a time there (``families._row_exact``).
    exact_on_cuda = True

    def __init__(self, layer_kinds: list[LayerKind], heads: int, kv_heads: int, head_dim: int):
        self.layer_kinds = layer_kinds
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        kinds = sorted({k.window or 0 for k in layer_kinds})
        self.kind_index = [kinds.index(k.window or 0) for k in layer_kinds]
        # The shapes the compiled step has been traced for: (slots, each kind's columns).
        self.traced_shapes: list[tuple[int, tuple[int, ...]]] = []
        forward = self.forward

        def traced(*args):
            # Python runs this only while mx.compile traces a new shape.
            tokens, keys = args[0], args[4]
            self.traced_shapes.append((tokens.shape[0], tuple(sorted({k.shape[2] for k in keys}))))
            log.debug("decode step traced for %d slots, %s columns", *self.traced_shapes[-1])
            return forward(*args)

        self.compiled = mx.compile(traced) if COMPILE else None
        self.counts = uses_kernels()  # attention takes counts of visible keys, not a mask
        self.compile_max_slots = CUDA_COMPILE_MAX_SLOTS if cuda_attention.available() else None
        self.op_by_op_same_bits: bool | None = None  # unknown until a step past the limit

    @property
    def traces(self) -> int:
        """How many shapes the compiled step has been traced for."""
        return len(self.traced_shapes)

    def new_store(self) -> SlotStore:
        return SlotStore(self.layer_kinds, self.kv_heads, self.head_dim)

    def __call__(self, tokens: mx.array, store: SlotStore) -> mx.array:
        """Logits (slots, vocab) of one decode step; ``tokens`` is (slots,)."""
        positions, layouts = store.layout(counts=self.counts)
        rope_positions = store.rope_positions(positions)
        indices = [layouts[k].write_index for k in store.kinds]
        visible = [layouts[k].visible for k in store.kinds]
        args = (tokens, rope_positions, indices, visible, store.keys, store.values, *self.step_inputs(store))
        logits, store.keys, store.values = self._forward_for(store.slots, args)(*args)
        store.advance()
        return logits

    def _forward_for(self, slots: int, args: tuple):
        """The compiled forward, or op by op past ``compile_max_slots`` slots where the
        two give the same bits (checked on the first such step's arguments: ``forward``
        is pure, so running it twice changes nothing)."""
        if self.compiled is None:
            return self.forward
        if self.compile_max_slots is None or slots <= self.compile_max_slots:
            return self.compiled
        if self.op_by_op_same_bits is None:
            compiled, op_by_op = self.compiled(*args)[0], self.forward(*args)[0]
            self.op_by_op_same_bits = mx.array_equal(compiled, op_by_op).item()
            log.info("decode steps past %d slots: %s", self.compile_max_slots,
                     "op by op (the same bits as compiled)" if self.op_by_op_same_bits
                     else "compiled (op by op rounds differently here)")
        return self.forward if self.op_by_op_same_bits else self.compiled

    def step_inputs(self, store: SlotStore) -> tuple:
        """Further per-row arrays of this step, made from what the host knows (the
        store's lengths), passed to ``forward`` after ``values``."""
        return ()

    def forward(self, tokens, positions, indices, visible, keys, values, *inputs):
        raise NotImplementedError


class KVWriter:
    """One step's writes into the store's per-layer keys/values (lists the forward
    function owns): each layer writes its rows' new key/value at their columns and
    returns its whole keys/values (attention reads the columns its kind makes visible)."""

    def __init__(self, decoder: StepDecoder, indices, keys, values):
        self.decoder = decoder
        self.indices = indices
        self.keys, self.values = list(keys), list(values)

    def __call__(self, layer: int, k: mx.array, v: mx.array):
        index = self.indices[self.decoder.kind_index[layer]]
        self.keys[layer] = mx.put_along_axis(self.keys[layer], index, k, axis=2)
        self.values[layer] = mx.put_along_axis(self.values[layer], index, v, axis=2)
        return self.keys[layer], self.values[layer]
