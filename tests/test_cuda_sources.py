"""Every CUDA kernel the engine launches compiles, as MLX's CUDA backend builds it, with
no register spills.

MLX writes a custom kernel as one plain function: the inputs and outputs with concrete
types, the template arguments as ``constexpr`` constants, then the source. Outside a
template both branches of an ``if constexpr`` are checked, so a branch that does not
fit this launch's types fails to compile on the GPU although the CPU emulation (where
the kernels are templates) builds it. Here the engine's own launch functions run on
the CPU with ``mx.fast.cuda_kernel`` recording each launch; each distinct kernel is
written out the way MLX writes it and compiled for sm_90 with nvcc. Needs a CUDA
toolkit (no GPU); skipped elsewhere, CI included."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

import kernel_emulation as emulation
from vlm_serve.engine import cuda_matmul, padded_matmul, tower_gelu
from vlm_serve.engine.decode import cuda_attention, cuda_heads, cuda_norms

TOOLKIT = emulation.cuda_toolkit("bin/nvcc")
# MLX's device headers a kernel includes, as stand-ins (MLX's CUDA library embeds its own).
MLX_HEADERS = Path(__file__).parent / "mlx_device_headers"
NVCC = f"{TOOLKIT}/bin/nvcc" if TOOLKIT else shutil.which("nvcc")
pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="needs nvcc (a CUDA toolkit)"),
    pytest.mark.skipif(not os.environ.get("VLM_SERVE_SLOW_TESTS"), reason="VLM_SERVE_SLOW_TESTS=1"),
]

CUDA_TYPES = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half",
              mx.int32: "int32_t", mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.bool_: "bool"}

# What MLX's default header gives a kernel, for the names the engine's kernels use.
PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cstdint>
struct Shape { int32_t data[10]; __device__ int32_t operator[](int i) const { return data[i]; } };
struct Strides { int64_t data[10]; __device__ int64_t operator[](int i) const { return data[i]; } };
#define inf __int_as_float(0x7f800000)
"""


def _constant(name: str, value) -> str:
    if isinstance(value, bool):
        return f"  constexpr bool {name} = {str(value).lower()};\n"
    if isinstance(value, int):
        return f"  constexpr int {name} = {value};\n"
    return f"  using {name} = {CUDA_TYPES[value]};\n"


class Launches:
    """Stands in for ``mx.fast.cuda_kernel``: each launch's kernel source as MLX writes
    it (``mlx/backend/cuda/custom_kernel.cpp``), by kernel name; outputs are zeros."""

    def __init__(self):
        self.sources: dict[str, str] = {}

    def cuda_kernel(self, name, input_names, output_names, source, header="", **_):
        def launch(inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), **__):
            params = []
            for input_name, array in zip(input_names, inputs):
                params.append(f"const {CUDA_TYPES[array.dtype]}* {input_name}")
                for suffix, kind in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
                    if array.ndim > 0 and f"{input_name}_{suffix}" in source:
                        params.append(f"const __grid_constant__ {kind} {input_name}_{suffix}")
            params += [f"{CUDA_TYPES[dtype]}* {output}" for output, dtype in zip(output_names, output_dtypes)]
            tag = "".join(f"_{CUDA_TYPES.get(v, v) if not isinstance(v, bool) else 'ft'[v]}" for _, v in template)
            kernel = re.sub(r"\W", "_", f"{name}{tag}")
            self.sources[kernel] = (
                f"{PRELUDE}{header}\nnamespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n"
                f"__global__ void {kernel}(\n    {', '.join(params)}) {{\n"
                f"{''.join(_constant(n, v) for n, v in template)}\n{source}\n}}\n}}\n")
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return launch


KERNEL_CACHES = [cuda_matmul._kernel, padded_matmul._pad_kernel, cuda_attention._flash_kernel,
                 cuda_attention._kernels, cuda_norms._kernel, cuda_heads._kernel, tower_gelu._gelu_kernel]


@pytest.fixture
def launches(monkeypatch):
    recorder = Launches()
    for cache in KERNEL_CACHES:
        cache.cache_clear()
    monkeypatch.setattr(mx.fast, "cuda_kernel", recorder.cuda_kernel)
    yield recorder
    for cache in KERNEL_CACHES:
        cache.cache_clear()


def _compile(item: tuple[str, str]) -> tuple[str, str | None]:
    """(kernel, None) where nvcc compiles it with no spills, else (kernel, what went wrong)."""
    kernel, source = item
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{kernel}.cu"
        path.write_text(source)
        run = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", f"-I{MLX_HEADERS}", "-c", str(path),
                              "-o", str(path.with_suffix(".o")), "-Xptxas", "-v"], capture_output=True, text=True)
    output = run.stdout + run.stderr
    if run.returncode:
        return kernel, "\n".join(line for line in output.splitlines() if "error" in line)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", output)]
    return kernel, f"spills {max(spills)} bytes" if any(spills) else None


def _assert_all_compile(sources: dict[str, str]) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = {k: why for k, why in pool.map(_compile, sources.items()) if why}
    assert not failures, failures


def _layer(width: int, out: int, dtype, bias: bool, bits: int | None = None) -> nn.Module:
    layer = nn.Linear(width, out, bias=bias)
    layer.update({"weight": layer.weight.astype(dtype)} | ({"bias": layer.bias.astype(dtype)} if bias else {}))
    return nn.QuantizedLinear.from_linear(layer, group_size=64, bits=bits) if bits else layer


def test_every_matmul_kernel_compiles(launches, monkeypatch):
    """Plain bfloat16 weights at each block height (with rows loaded ahead and not), 4-
    and 8-bit weights, float32; with and without a bias; the padded passes' rows."""
    for rows in (1, 40, 200):
        cuda_matmul.linear(mx.zeros((rows, 256), mx.bfloat16), _layer(256, 96, mx.bfloat16, True))
    cuda_matmul.linear(mx.zeros((3, 200), mx.bfloat16), _layer(200, 40, mx.bfloat16, False))  # a tail past 64
    for bits in (4, 8):
        cuda_matmul.linear(mx.zeros((40, 256), mx.bfloat16), _layer(256, 96, mx.bfloat16, True, bits))
    cuda_matmul.linear(mx.zeros((3, 72), mx.float32), _layer(72, 40, mx.float32, True))
    monkeypatch.setattr(padded_matmul, "cuda_available", lambda: True)
    padded_matmul.pad_rows(mx.zeros((64, 10240), mx.bfloat16), 320)  # a padded pass's zero rows
    assert len(launches.sources) >= 6
    _assert_all_compile(launches.sources)


def test_every_attention_and_norm_kernel_compiles(launches, monkeypatch):
    """The tensor-core prefill kernel at each head size it may take, whole and in
    chunks, masked and not; the per-query prefill kernel, masked and not; decode; the
    parts' combination; the fused residual norm; the attention heads, a pass's (and a
    step's)."""
    monkeypatch.setattr(cuda_attention, "FLASH_MAX_DIM", 512)

    def qkv(prompts, heads, kv_heads, length, columns, dim, dtype):
        return (mx.zeros((prompts, heads, length, dim), dtype), mx.zeros((prompts, kv_heads, columns, dim), dtype),
                mx.zeros((prompts, kv_heads, columns, dim), dtype))

    for dim, chunk in ((64, 0), (256, 0), (256, 256), (512, 0), (512, 256)):
        cuda_attention.flash_prefill_attention(*qkv(1, 8, 4, 70, 70, dim, mx.bfloat16), dim**-0.5, chunk=chunk)
    mask = mx.ones((1, 70, 70), mx.bool_)
    cuda_attention.flash_prefill_attention(*qkv(1, 8, 4, 70, 70, 128, mx.bfloat16), 0.1, causal=False, mask=mask,
                                           chunk=256)
    for dtype in (mx.float32, mx.bfloat16):
        q, k, v = qkv(2, 8, 4, 20, 40, 64, dtype)
        cuda_attention.prefill_attention(q, k, v, 0.125, window=16, queries=1)
        cuda_attention.prefill_attention(q, k, v, 0.125, causal=False, mask=mx.ones((2, 20, 40), mx.bool_),
                                         queries=1)
        # A key's runs in whole groups of loads and not; 7 heads of 128 a block, whose
        # lanes load one at a time.
        for heads, dim in ((8, 64), (8, 80), (8, 256), (28, 128)):
            q, k, v = qkv(3, heads, 4, 1, 40, dim, dtype)
            for pipeline in (0, 5):  # each lane's own loads; asynchronous copies in 5 stages
                monkeypatch.setattr(cuda_attention, "PIPELINE", pipeline)
                cuda_attention.decode_attention(q, k, v, mx.array([5, 40, 1], mx.int32), dim**-0.5)
        for width in (256, 2560):  # the 4B's rows keep ten elements a thread in registers
            hidden, weight = mx.zeros((3, width), dtype), mx.zeros((width,), dtype)
            for form in cuda_norms.FORMS:
                monkeypatch.setattr(cuda_norms, "FORM", form)
                cuda_norms.fused_add_norm(hidden, hidden, weight, weight, 1e-6)
        for dim in (80, 256):  # threads past the head's pairs, and not
            norm = mx.zeros((dim,), dtype)
            heads = cuda_heads.AttentionHeads(8, 4, dim, norm, norm, 1e-6, nn.RoPE(dim, base=1e6, scale=0.125))
            heads.fused(mx.zeros((6, 16 * dim), dtype), mx.zeros((3,), mx.int32), length=2)
    assert len(launches.sources) >= 16
    assert cuda_attention.loads_in_flight(7, 128, mx.bfloat16, 1) == (1, 1)
    _assert_all_compile(launches.sources)


def test_the_tower_gelu_kernel_compiles(launches):
    """The vision towers' GELU in one kernel (``tower_gelu``'s ``kernel`` form), for
    both 16-bit types."""
    for dtype in tower_gelu.DTYPES:
        tower_gelu.gelu_kernel(mx.zeros((3, 97, 4304), dtype))
    assert len(launches.sources) == 2
    _assert_all_compile(launches.sources)
