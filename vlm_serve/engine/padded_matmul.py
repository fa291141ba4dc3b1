"""MLX's own matmul with each row's bits independent of the other rows, by padding a
pass's rows to a size from which MLX was seen to add every row's terms in one order.

On H100 and H200 cards (MLX 0.32.4), MLX's matmul gives a row the same bits whatever
the other rows of its pass hold, and wherever the row sits in it. Across pass sizes it
does so too, once a pass has enough rows:
- 8 rows for most of the Gemma-3-4B shape's layers;
- 264 rows for its down projection (below that, likely, its long input dimension is
  split across blocks, whose sums meet in another order);
- one row alone takes a gemv of its own.
(``bench/results/gpu-h200-mlx-matmul-rows``, ``bench/results/gpu-h100-padded-matmul``.)

Neither MLX nor cuBLAS promises any of this, so it is checked at load for each layer
shape, over every pass size the engine may issue (``SIZES``): for that model about 2 s
when the sizes ended at 2,048 rows. A shape's floor is the smallest size from which
every larger one gives probe rows the same bits, placed first in the pass or last. A
pass is then padded with zero rows up to the next size at or above the floor; a pass
longer than the largest size goes in pieces of it. A shape without a floor low enough
to pay (``MAX_FLOOR``) stays on the row-exact kernel (``cuda_matmul``).

The default on CUDA (``row_exact``). On an H200, against the kernel: a burst of 64
image requests in 6.4 instead of 17.7 s (mlx-vlm: 9.2 s), and 0.72x the tokens/s of a
lone request, whose step pads every layer to 8 rows and the down projection to 320
(``bench/results/gpu-h200-padded-default``, measured before a step's padded products
lost their no-op nodes).
"""

from __future__ import annotations

import functools
import os
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..mlx_runtime import cuda_available, exact_grid_block
from .cuda_matmul import in_weight_dtype, own_bias, quantized, weight_dtype

# The pass sizes a padded pass may take, in rows: steps of 64 up to ``LARGEST``, and
# every number of slots a decode step may have from 8 up (``decode.store``'s buckets),
# so that a step of any of them multiplies its own rows, none padded.
#
# ``LARGEST`` is a GPU turn's prefill budget, which one pass shared by several prompts
# may fill. A pass past it goes in pieces, each a matmul more and their concatenation a
# copy of the whole output: a burst's shared passes of ~3,500 tokens went in two when
# the sizes ended at 2,048, ~200 MB of copies a layer at the Gemma-3-4B shape
# (VLM_SERVE_PAD_LARGEST=2048 ends them there again, for comparison).
LARGEST = int(os.environ.get("VLM_SERVE_PAD_LARGEST", "4096"))
# ``FINE_SIZES``: every 8 rows from 264 to 312 as well. The Gemma-3-4B shape's down
# projection keeps a row's bits from 264 rows on an H200, so a decode step pads it to
# 264 instead of 320; under ncu its 68 launches (two 64-row steps) took 2.04 ms against
# 2.65-2.67 (bench/results/gpu-h200-fine-pad). VLM_SERVE_PAD_SIZES=coarse leaves them out.
FINE_SIZES = () if os.environ.get("VLM_SERVE_PAD_SIZES") == "coarse" else tuple(range(264, 320, 8))
SIZES = tuple(sorted({8, 16, 24, 32, 48, 96, *range(64, LARGEST + 1, 64), *FINE_SIZES}))
# A floor above this costs a decode step more in padding than the row-exact kernel.
MAX_FLOOR = 512
PROBE_ROWS = 8


def product(x: mx.array, module: nn.Module, weight_t: mx.array | None = None) -> mx.array:
    """``x @ W.T`` (plus the bias) as MLX's layer computes it; an embedding table as
    its ``as_linear``. ``weight_t`` is ``W.T`` taken once (``transposed``), else it is
    taken here, a node of the graph."""
    bias = own_bias(module)
    if quantized(module):
        out = mx.quantized_matmul(x, module.weight, module.scales, module.biases, transpose=True,
                                  group_size=module.group_size, bits=module.bits)
        return out if bias is None else out + bias
    w_t = module.weight.T if weight_t is None else weight_t
    return x @ w_t if bias is None else mx.addmm(bias, x, w_t)


def transposed(module: nn.Module) -> mx.array | None:
    """A plain layer's ``W.T``, evaluated once: a view of the same memory, so the
    matmul reads the very array it reads from a ``W.T`` taken in the graph, and gives
    the same bits, without that node in every decode step. None for a quantized layer,
    whose kernel transposes."""
    if quantized(module):
        return None
    weight_t = module.weight.T
    mx.eval(weight_t)
    return weight_t


def _shape_key(module: nn.Module) -> tuple:
    group = (module.bits, module.group_size) if quantized(module) else None
    return (tuple(module.weight.shape), str(weight_dtype(module)), group, own_bias(module) is not None)


def floor_of(module: nn.Module) -> int | None:
    """The smallest pass size from which ``module``'s shape keeps a row's bits, or None
    (checked once per shape, on first sight: call it outside a compiled function)."""
    global _CHECK_SECONDS
    key = _shape_key(module)
    if key not in _FLOORS:
        started = time.perf_counter()
        _FLOORS[key] = check(module)
        _CHECK_SECONDS += time.perf_counter() - started
    return _FLOORS[key]


_FLOORS: dict[tuple, int | None] = {}  # by layer shape
_CHECK_SECONDS = 0.0  # spent checking them, for the startup log


def check(module: nn.Module) -> int | None:
    """Multiply probe rows in a pass of every size, the other rows random, the probes
    both first and last: the smallest size from which every larger pass gives them the
    same bits in both places (as does the largest pass run again), if at most
    ``MAX_FLOOR``."""
    width = module.weight.shape[1] * (32 // module.bits if quantized(module) else 1)
    rng = np.random.default_rng(0)
    rows = mx.array(rng.standard_normal((SIZES[-1], width)).astype(np.float32)).astype(weight_dtype(module))
    if quantized(module) and not _near_dequantized(rows, module):
        return None

    def probe_bits(size: int) -> bytes | None:
        """The probes' bits in a pass of ``size``, or None where the copy last in the
        pass got others than the one first (a row's bits would follow its place)."""
        out = product(mx.concatenate([rows[:size - PROBE_ROWS], rows[:PROBE_ROWS]]), module)
        first, last = (np.array(part.astype(mx.float32)).tobytes()
                       for part in (out[:PROBE_ROWS], out[size - PROBE_ROWS:]))
        return first if first == last else None

    bits = {size: probe_bits(size) for size in SIZES}
    reference = bits[SIZES[-1]]
    if reference is None or probe_bits(SIZES[-1]) != reference:
        return None  # the largest pass: its rows follow their place, or it drifts run to run
    floor = None
    for size in reversed(SIZES):
        if bits[size] != reference:
            break
        floor = size
    return floor if floor is not None and floor <= MAX_FLOOR else None


def describe() -> str:
    """The shapes checked so far and their floors, for the startup log."""
    floors = "; ".join(f"{'x'.join(map(str, key[0]))} {key[1]}: "
                       f"{'from ' + str(floor) + ' rows' if floor else 'the kernel'}"
                       for key, floor in _FLOORS.items())
    return f"{floors} (checked in {_CHECK_SECONDS:.1f} s)"


def _near_dequantized(rows: mx.array, module: nn.Module, checked: int = 64) -> bool:
    """Whether a quantized layer's product agrees with its dequantized weights' as
    ``quantized_check`` measures it (MLX 0.32.4's CUDA 4-bit matmul is wrong past one
    row for layers of 64 inputs and up to 128 outputs), for the first ``checked`` rows
    in a pass of their own and in the largest pass (whose bits every pass from the
    floor on shares)."""
    from . import quantized_check  # (it reads row_exact, which imports this)

    columns = quantized_check.sampled_columns(module.weight.shape[0])
    with mx.stream(mx.cpu):
        expected = rows[:checked].astype(mx.float32) @ quantized_check.dequantized_rows(module, columns).T
        bias = own_bias(module)
        if bias is not None:
            expected = expected + bias[columns].astype(mx.float32)
    products = (product(rows[:checked], module), product(rows, module)[:checked])
    return all(quantized_check.relative_error(out[:, columns], expected) <= quantized_check.TOLERANCE
               for out in products)


def pass_size(rows: int, floor: int) -> int:
    """The size a pass of ``rows`` (at most the largest size) is padded to."""
    return next(size for size in SIZES if size >= max(rows, floor))


def linear(x: mx.array, module: nn.Module, floor: int, weight_t: mx.array | None = None) -> mx.array:
    """``product(x, module)``, its rows padded to a checked size (in pieces of the
    largest). Inputs of another dtype than the layer's are rounded to it, as the check
    multiplied (and as the kernel does), and the result is given in MLX's dtype."""
    if x.dtype != weight_dtype(module):
        return in_weight_dtype(lambda x, module: _padded(x, module, floor, weight_t), x, module)
    return _padded(x, module, floor, weight_t)


def _padded(x: mx.array, module: nn.Module, floor: int, weight_t: mx.array | None) -> mx.array:
    """``linear`` in the layer's dtype. A pass already of a checked size takes no
    padding, and 2-D rows no reshape: in a decode step each would be a node more."""
    if x.ndim != 2:
        out = _padded(x.reshape(-1, x.shape[-1]), module, floor, weight_t)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    n = x.shape[0]
    if n > SIZES[-1]:
        return mx.concatenate([_padded(x[start:start + SIZES[-1]], module, floor, weight_t)
                               for start in range(0, n, SIZES[-1])])
    size = pass_size(n, floor)
    if size == n:
        return product(x, module, weight_t)
    return product(pad_rows(x, size), module, weight_t)[:n]


# The engine's kernel for a pass's zero rows (off: MLX's ``pad``, for comparison).
PAD_KERNEL = True


def pad_rows(x: mx.array, size: int) -> mx.array:
    """``x`` (rows, width) with zero rows after it up to ``size`` rows. On CUDA one
    kernel writing each word once: MLX's ``pad`` fills the whole output, then copies
    ``x`` in, two kernels. For a Gemma-3-4B decode step's down projection (64 rows
    padded to 320 of 10,240) on an H200, 4 us against 24 us: 0.7 ms less in a step of
    34 layers (``bench/decode_kernels.py``)."""
    width = x.shape[1]
    if not (PAD_KERNEL and cuda_available() and (width * x.dtype.size) % 16 == 0):
        return mx.pad(x, ((0, size - x.shape[0]), (0, 0)))
    row_words = width * x.dtype.size // 16
    words = size * row_words
    # The grid is exactly the output's words, so the kernel needs the size neither as
    # an input (a read per thread made it 5x slower on an H200) nor as a template
    # argument (a compile for each pass size a prefill meets).
    (out,) = _pad_kernel()(
        inputs=[x],
        template=[("ROW_WORDS", row_words)],
        grid=(words, 1, 1),
        threadgroup=(exact_grid_block(words), 1, 1),
        output_shapes=[(size, width)],
        output_dtypes=[x.dtype],
    )
    return out


@functools.cache
def _pad_kernel():
    return mx.fast.cuda_kernel(
        name="vlm_pad_rows",
        input_names=["x"],
        output_names=["out"],
        source="""
  // One 16-byte word of the output a thread: x's where its row is one of x's, else zeros.
  const size_t word = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint4 value = make_uint4(0, 0, 0, 0);
  if (word / ROW_WORDS < (size_t)x_shape[0]) value = reinterpret_cast<const uint4*>(x)[word];
  reinterpret_cast<uint4*>(out)[word] = value;
""",
    )
