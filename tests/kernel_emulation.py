"""The engine's CUDA kernels, built from their own source strings, on the CPU emulation of
``cuda_emulator.h`` (``tests/test_cuda_emulated.py``). Needs g++ with C++20 and the CUDA
toolkit's headers (for the bfloat16 types); no GPU."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from vlm_serve.engine import cuda_matmul
from vlm_serve.engine.decode import cuda_attention, cuda_heads, cuda_norms
from vlm_serve.mlx_runtime import kernel_constant

HERE = Path(__file__).parent
BF16 = "__nv_bfloat16"


def cuda_toolkit(having: str) -> str | None:
    """The first CUDA toolkit (``CUDA_HOME``, or the usual places) with the file
    ``having`` (a path inside it), as its folder."""
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    return next((r for r in roots if r and Path(f"{r}/{having}").exists()), None)


def cuda_include() -> str | None:
    """A CUDA toolkit's include folder."""
    root = cuda_toolkit("include/cuda_bf16.h")
    return root and f"{root}/include"


def available() -> bool:
    return shutil.which("g++") is not None and cuda_include() is not None


def build(source: str) -> ctypes.CDLL:
    """``source`` compiled as a shared library (cached by its text)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "vlm-serve-cuda-emulation"
    folder.mkdir(exist_ok=True)
    library = folder / f"{digest}.so"
    if not library.exists():
        cpp = folder / f"{digest}.cpp"
        cpp.write_text(source)
        subprocess.run(["g++", "-std=c++20", "-O2", "-fno-strict-aliasing", "-w", "-fPIC", "-shared",
                        "-pthread", f"-I{cuda_include()}", f"-I{HERE}", str(cpp), "-o", str(library)],
                       check=True)
    return ctypes.CDLL(str(library))


def causal_mask(length: int, columns: int, window: int = 0) -> np.ndarray:
    """(1, length, columns): which columns the last ``length`` queries of ``columns``
    see, causally and within ``window`` columns where given (mlx-lm's masks)."""
    own = np.arange(columns - length, columns)[:, None]
    mask = np.arange(columns)[None] <= own
    if window:
        mask &= np.arange(columns)[None] > own - window
    return mask[None]


def to_bf16(a) -> np.ndarray:
    """bfloat16 bits (round to nearest even) of ``a``."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rms_norm64(a: np.ndarray, w_bits: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of float64 ``a`` over its last axis by bfloat16 weights ``w_bits``."""
    return a / np.sqrt((a * a).mean(-1, keepdims=True) + eps) * from_bf16(w_bits)


def _ptr(a: np.ndarray | None):
    """A pointer to ``a``'s data, which the kernels read as a row-major array."""
    if a is None:
        return ctypes.c_void_p(0)
    assert a.flags.c_contiguous, "the kernels take row-major arrays"
    return a.ctypes.data_as(ctypes.c_void_p)


# -- the row-exact matmul -----------------------------------------------------------------


class Matmul:
    """``x @ W.T + bias`` (bfloat16; plain weights of ``width`` x ``out``, or MLX's affine
    ``bits``-bit ones in groups of ``group``) through each of ``cuda_matmul``'s kernels,
    the launch as ``cuda_matmul.linear`` makes it."""

    def __init__(self, width: int, out: int, bits: int | None = None, group: int = 64):
        self.width, self.out, self.bits = width, out, bits
        warps = cuda_matmul.warps_for(width)
        pair = "template <typename T>" + cuda_matmul._HEADER.split("template <typename T>", 1)[1]
        bias = "s += static_cast<float>(bias[col]);"
        load = cuda_matmul._LOAD_QUANTIZED if bits else cuda_matmul._LOAD_PLAIN
        one_pass = (cuda_matmul._SOURCE.replace("LOAD_WEIGHTS", load)
                    .replace("TAIL", "" if bits else cuda_matmul._TAIL).replace("BIAS", bias))
        weights = "const uint32_t* w, const T* scales, const T* biases" if bits else "const T* w"
        args = f"const T* x, const int* x_shape, {weights}, const T* bias, T* y"
        quant = f", {bits}, {group}" if bits else ""
        call_weights = "(const uint32_t*)w, S, Z" if bits else f"(const {BF16}*)w"
        launches = []
        for tiles in (1, 2, 4, 8):
            for ahead in (0, 1):
                for rows_first in (0, 1):
                    blocks = [f"{-(-out // 32)}u", f"(unsigned)((M + {16 * tiles - 1}) / {16 * tiles})"]
                    grid = ", ".join(blocks[::-1] if rows_first else blocks)
                    flags = f"{'true' if ahead else 'false'}, {'true' if rows_first else 'false'}"
                    launches.append(
                        f"if (tiles == {tiles} && ahead == {ahead} && rows_first == {rows_first}) "
                        f"launch({{{grid}, 1}}, {{{warps * 32}, 1, 1}}, [&] {{ "
                        f"one_pass<{BF16}, {width}, {out}{quant}, {tiles}, 4, {warps}, {flags}>"
                        f"(X, shape, {call_weights}, Bias, Y); }});")
        body = "\n  ".join(launches)
        quant_params = ", int BITS, int GROUP" if bits else ""
        self.lib = build(f"""#include "cuda_emulator.h"
{pair}
template <typename T, int K, int N{quant_params}, int TILES, int FT, int WARPS, bool PREFETCH_ROWS,
          bool ROWS_FIRST>
void one_pass({args}) {{
{one_pass}
}}
extern "C" void matmul(const void* x, int M, const void* w, const void* scales, const void* biases,
                       const void* bias, void* y, int tiles, int ahead, int rows_first) {{
  int shape[2] = {{M, {width}}};
  auto X = (const {BF16}*)x; auto S = (const {BF16}*)scales; auto Z = (const {BF16}*)biases;
  auto Bias = (const {BF16}*)bias; auto Y = ({BF16}*)y;
  {body}
}}
""")

    def __call__(self, x, w, bias, tiles: int, ahead: bool = False, rows_first: bool = False,
                 scales=None, biases=None) -> np.ndarray:
        x = np.ascontiguousarray(x)
        y = np.zeros((x.shape[0], self.out), np.uint16)
        self.lib.matmul(_ptr(x), ctypes.c_int(x.shape[0]), _ptr(w), _ptr(scales), _ptr(biases), _ptr(bias),
                        _ptr(y), ctypes.c_int(tiles), ctypes.c_int(int(ahead)), ctypes.c_int(int(rows_first)))
        return y


def quantize(w: np.ndarray, bits: int, group: int):
    """MLX's affine quantization of ``w`` (out, width): packed codes (uint32, low bits
    first), bfloat16 scales and biases per ``group``, and the weights they stand for."""
    out, width = w.shape
    grouped = w.reshape(out, width // group, group)
    low, high = grouped.min(-1), grouped.max(-1)
    scales = to_bf16((high - low) / (2**bits - 1))
    biases = to_bf16(low)
    s, z = from_bf16(scales)[..., None], from_bf16(biases)[..., None]
    codes = np.clip(np.round((grouped - z) / s), 0, 2**bits - 1).astype(np.uint32).reshape(out, width)
    per_word = 32 // bits
    words = codes.reshape(out, width // per_word, per_word) << (bits * np.arange(per_word, dtype=np.uint32))
    packed = np.bitwise_or.reduce(words, axis=-1).astype(np.uint32)
    dequantized = (codes.reshape(out, width // group, group) * s + z).reshape(out, width)
    return packed, scales, biases, dequantized


# -- attention ----------------------------------------------------------------------------


class Attention:
    """``cuda_attention``'s prefill kernels (per query, with ``queries`` a block, and the
    tensor-core one, over ``flash_chunk`` columns a block or all of them) and decode
    kernel, for bfloat16 with ``heads`` query heads, ``kv_heads`` key/value heads of
    ``dim``, scale ``scale``: each call launched as the module does. ``loads``: a lane's
    loads in flight of keys and of values (default the module's); ``pipeline``: decode's
    stages of asynchronous copies (default as the module chooses)."""

    CASES = [(True, 0), (True, 48), (False, 0)]  # (causal, window) instantiated

    def __init__(self, heads: int = 4, kv_heads: int = 2, dim: int = 64, scale: float = 0.125,
                 flash_chunk: int = 0, loads: tuple[int, int] | None = None, pipeline: int | None = None):
        self.heads, self.kv_heads, self.dim, self.scale = heads, kv_heads, dim, scale
        self.flash_chunk = flash_chunk
        group = cuda_attention.heads_per_block(heads, kv_heads, dim)
        a = cuda_attention
        common = [BF16, dim, kv_heads, group, a.CHUNK, a.WARPS]
        decode_common = [BF16, dim, kv_heads, group, a.DECODE_CHUNK, a.DECODE_WARPS]
        key_loads, value_loads = loads or (a.KEY_LOADS, a.VALUE_LOADS)
        if pipeline is None:
            pipeline = a.pipeline_stages(group, dim, mx.bfloat16)
        per_query, flash = [], []
        for queries in (1, 2, 4):
            for causal, window in self.CASES:
                t = ", ".join(map(str, [*common, queries, str(causal).lower(), window, key_loads, value_loads, 0]))
                blocks = f"(unsigned)(B * ((L + {queries - 1}) / {queries}))"
                per_query.append(
                    f"if (queries == {queries} && causal == {int(causal)} && window == {window}) {{\n"
                    f"    if (mask) launch({{chunks, {heads // group}, {blocks}}}, {{{a.WARPS * 32}, 1, 1}}, [&] {{ "
                    f"masked<{t}>(Q, qs, K, ks, V, mask, ms, &shift, partial.data()); }});\n"
                    f"    else launch({{chunks, {heads // group}, {blocks}}}, {{{a.WARPS * 32}, 1, 1}}, [&] {{ "
                    f"prefill<{t}>(Q, qs, K, ks, V, &shift, partial.data()); }});\n  }}")
        # The tensor-core kernel writes the output, or with chunks each chunk's parts.
        flash_out = "flash_parts.data()" if flash_chunk else "O"
        rows = cuda_attention.flash_queries_per_block(dim)
        grid = f"{{(unsigned)((L + {rows - 1}) / {rows}), {heads}, (unsigned)B * flash_chunks}}"
        for causal, window in self.CASES:
            t = f"{BF16}, {dim}, {kv_heads}, {str(causal).lower()}, {window}, {flash_chunk}"
            flash.append(
                f"if (causal == {int(causal)} && window == {window}) {{\n"
                f"    if (mask) launch({grid}, {{128, 1, 1}}, [&] {{ "
                f"flash_masked<{t}>(Q, qs, K, ks, V, mask, ms, &shift, {flash_out}); }});\n"
                f"    else launch({grid}, {{128, 1, 1}}, [&] {{ flash<{t}>(Q, qs, K, ks, V, &shift, {flash_out}); }});\n  }}")
        prefill_params = ("template <typename T, int D, int KV_HEADS, int QG, int CHUNK, int WARPS, int QQ, "
                          "bool CAUSAL, int WINDOW, int KEY_LOADS, int VALUE_LOADS, int PIPELINE>")
        flash_params = "template <typename T, int D, int KV_HEADS, bool CAUSAL, int WINDOW, int CHUNK>"
        # Concrete, as MLX declares a kernel's outputs (g++ does not check a discarded branch
        # against them; tests/test_cuda_sources.py does, with nvcc).
        flash_type = "float" if flash_chunk else BF16
        qkv = "const T* q, const int* q_shape, const T* keys, const int* keys_shape, const T* values"
        mask_args = "const bool* mask, const int* mask_shape"
        row = a._COMMON + a._PREFILL_ROW
        nl = "\n  "
        self.lib = build(f"""#include "cuda_emulator.h"
{a._HEADER}
{kernel_constant("SCALE", scale)[0]}
{prefill_params}
void prefill({qkv}, const int* column_shift, float* partial) {{
{row.replace("  VISIBLE" + chr(10), a._ALL_VISIBLE) + a._PARTIAL}
}}
{prefill_params}
void masked({qkv}, {mask_args}, const int* column_shift, float* partial) {{
{row.replace("  VISIBLE" + chr(10), a._MASK_VISIBLE) + a._PARTIAL}
}}
template <typename T, int D, int KV_HEADS, int QG, int CHUNK, int WARPS, int QQ, int KEY_LOADS, int VALUE_LOADS,
          int PIPELINE>
void decode(const T* q, const T* keys, const int* keys_shape, const T* values, const int* counts, float* partial) {{
{a._COMMON + a._DECODE_ROW + a._PARTIAL}
}}
template <typename T, int D>
void combine(const float* partial, const int* partial_shape, T* out) {{
{a._COMBINE}
}}
{flash_params}
void flash({qkv}, const int* column_shift, {flash_type}* out) {{
{a._FLASH.replace("  VISIBLE" + chr(10), a._ALL_VISIBLE)}
}}
{flash_params}
void flash_masked({qkv}, {mask_args}, const int* column_shift, {flash_type}* out) {{
{a._FLASH.replace("  VISIBLE" + chr(10), a._FLASH_MASK_VISIBLE)}
}}
static void combined(std::vector<float>& partial, int rows, unsigned chunks, void* out) {{
  int ps[4] = {{rows, {heads}, (int)chunks, {dim} + 2}};
  launch({{1, {heads}, (unsigned)rows}}, {{128, 1, 1}}, [&] {{ combine<{BF16}, {dim}>(partial.data(), ps, ({BF16}*)out); }});
}}
extern "C" void attend(const void* q, int B, int L, const void* k, const void* v, int N, const bool* mask,
                       int mask_rows, int causal, int window, int queries, int tensor_cores, int shift,
                       void* out) {{
  int qs[4] = {{B, {heads}, L, {dim}}}, ks[4] = {{B, {kv_heads}, N, {dim}}}, ms[3] = {{mask_rows, L, N}};
  auto Q = (const {BF16}*)q; auto K = (const {BF16}*)k; auto V = (const {BF16}*)v; auto O = ({BF16}*)out;
  if (tensor_cores) {{
    const unsigned flash_chunks = {f"(N + shift + {flash_chunk - 1}) / {flash_chunk}" if flash_chunk else 1};
    std::vector<float> flash_parts({f"(size_t)B * L * {heads} * flash_chunks * ({dim} + 2)" if flash_chunk else 0});
  {nl.join(flash)}
    if (!flash_parts.empty()) combined(flash_parts, B * L, flash_chunks, out);
    return;
  }}
  const unsigned chunks = (N + shift + {a.CHUNK - 1}) / {a.CHUNK};
  std::vector<float> partial((size_t)B * L * {heads} * chunks * ({dim} + 2));
  {nl.join(per_query)}
  combined(partial, B * L, chunks, out);
}}
extern "C" void decode_rows(const void* q, int slots, const void* k, const void* v, int N, const int* counts,
                            void* out) {{
  int ks[4] = {{slots, {kv_heads}, N, {dim}}};
  auto Q = (const {BF16}*)q; auto K = (const {BF16}*)k; auto V = (const {BF16}*)v;
  const unsigned chunks = (N + {a.DECODE_CHUNK - 1}) / {a.DECODE_CHUNK};
  std::vector<float> partial((size_t)slots * {heads} * chunks * ({dim} + 2));
  launch({{chunks, {heads // group}, (unsigned)slots}}, {{{a.DECODE_WARPS * 32}, 1, 1}}, [&] {{
    decode<{", ".join(map(str, decode_common))}, 1, {key_loads}, {value_loads}, {pipeline}>(Q, K, ks, V, counts,
                                                                   partial.data()); }});
  combined(partial, slots, chunks, out);
}}
""")

    def prefill(self, q, k, v, mask=None, causal=True, window=0, queries=1, tensor_cores=False, origin=0):
        """(B * L, heads * dim) bfloat16 bits: as ``cuda_attention.prefill_attention``
        (``tensor_cores``: ``flash_prefill_attention``), the keys' column 0 at position
        ``origin``."""
        shift = cuda_attention.column_shift(origin, self.flash_chunk if tensor_cores else None)
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
        B, _, L, _ = q.shape
        out = np.zeros((B * L, self.heads * self.dim), np.uint16)
        mask = None if mask is None else np.ascontiguousarray(mask, np.bool_)
        self.lib.attend(_ptr(q), ctypes.c_int(B), ctypes.c_int(L), _ptr(k), _ptr(v), ctypes.c_int(k.shape[2]),
                        _ptr(mask), ctypes.c_int(0 if mask is None else mask.shape[0]), ctypes.c_int(int(causal)),
                        ctypes.c_int(window), ctypes.c_int(queries), ctypes.c_int(int(tensor_cores)),
                        ctypes.c_int(shift), _ptr(out))
        return out

    def decode(self, q, k, v, counts) -> np.ndarray:
        """(slots, heads * dim) bfloat16 bits: as ``cuda_attention.decode_attention``."""
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
        out = np.zeros((q.shape[0], self.heads * self.dim), np.uint16)
        counts = np.ascontiguousarray(counts, np.int32)
        self.lib.decode_rows(_ptr(q), ctypes.c_int(q.shape[0]), _ptr(k), _ptr(v), ctypes.c_int(k.shape[2]),
                             _ptr(counts), _ptr(out))
        return out

    def reference(self, q, k, v, mask=None, causal=True, window=0) -> np.ndarray:
        """The same attention in float64 (from the bfloat16 inputs)."""
        B, _, L, _ = q.shape
        N = k.shape[2]
        repeat = self.heads // self.kv_heads
        qf = from_bf16(q).astype(np.float64)
        kf = np.repeat(from_bf16(k).astype(np.float64), repeat, axis=1)
        vf = np.repeat(from_bf16(v).astype(np.float64), repeat, axis=1)
        scores = np.einsum("bhld,bhnd->bhln", qf, kf) * self.scale
        seen = causal_mask(L, N, window)[0] if causal else np.ones((L, N), bool)
        seen = seen[None, None] if mask is None else seen[None, None] & np.asarray(mask)[:, None]
        scores = np.where(seen, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out = np.einsum("bhln,bhnd->bhld", weights, vf)
        return out.transpose(0, 2, 1, 3).reshape(B * L, self.heads * self.dim)


# -- a decode step's heads --------------------------------------------------------------


class Heads:
    """``cuda_heads``' kernel for bfloat16: a layer's query, key and value heads from the
    fused projection's output, launched as ``AttentionHeads.fused`` does."""

    def __init__(self, heads: int, kv_heads: int, dim: int, eps: float, base: float, scale: float):
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.eps, self.base, self.scale = eps, base, scale
        threads = -(-(dim // 2) // 32) * 32
        defines = "".join(kernel_constant(name, value)[0] for name, value in
                          (("EPS", eps), ("LOG2_BASE", math.log2(base)), ("ROPE_SCALE", scale)))
        self.lib = build(f"""#include "cuda_emulator.h"
{cuda_norms.BLOCK_SUM}
{defines}
template <typename T, int H, int KV, int D, int HALF, int THREADS>
void heads(const T* qkv, const int* qkv_shape, const T* q_norm, const T* k_norm, const int32_t* starts,
           const int* starts_shape, T* q, T* k, T* v) {{
{cuda_heads._SOURCE}
}}
extern "C" void run(const void* qkv, int tokens, const void* q_norm, const void* k_norm, const int32_t* starts,
                    int rows, void* q, void* k, void* v) {{
  int qkv_shape[2] = {{tokens, {(heads + 2 * kv_heads) * dim}}}, starts_shape[1] = {{rows}};
  launch({{(unsigned)tokens, {heads + 2 * kv_heads}, 1}}, {{{threads}, 1, 1}}, [&] {{
    heads<{BF16}, {heads}, {kv_heads}, {dim}, {dim // 2}, {threads}>(
        (const {BF16}*)qkv, qkv_shape, (const {BF16}*)q_norm, (const {BF16}*)k_norm, starts, starts_shape,
        ({BF16}*)q, ({BF16}*)k, ({BF16}*)v); }});
}}
""")

    def __call__(self, qkv, q_norm, k_norm, starts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q, k, v) bfloat16 bits, (rows, heads, length, dim) each: ``qkv`` holds
        ``length`` tokens of each row of ``starts`` (each row's first position)."""
        qkv = np.ascontiguousarray(qkv)
        tokens, rows = qkv.shape[0], len(starts)
        length = tokens // rows
        q, k, v = (np.zeros((rows, n, length, self.dim), np.uint16)
                   for n in (self.heads, self.kv_heads, self.kv_heads))
        self.lib.run(_ptr(qkv), ctypes.c_int(tokens), _ptr(np.ascontiguousarray(q_norm)),
                     _ptr(np.ascontiguousarray(k_norm)), _ptr(np.ascontiguousarray(starts, np.int32)),
                     ctypes.c_int(rows), _ptr(q), _ptr(k), _ptr(v))
        return q, k, v

    def reference(self, qkv, q_norm, k_norm, starts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same in float64 (from the bfloat16 inputs): RMSNorm, then the rotation."""
        rows = len(starts)
        length = qkv.shape[0] // rows
        x = from_bf16(qkv).astype(np.float64).reshape(rows, length, -1, self.dim).transpose(0, 2, 1, 3)
        q, k, v = np.split(x, [self.heads, self.heads + self.kv_heads], axis=1)

        half = self.dim // 2
        positions = np.asarray(starts, np.float64)[:, None] + np.arange(length)  # (rows, length)
        angles = (self.scale * positions)[:, None, :, None] * self.base ** (-np.arange(half) / half)
        cos, sin = np.cos(angles), np.sin(angles)

        def rotate(a):
            a1, a2 = a[..., :half], a[..., half:]
            return np.concatenate([a1 * cos - a2 * sin, a1 * sin + a2 * cos], axis=-1)

        return rotate(rms_norm64(q, q_norm, self.eps)), rotate(rms_norm64(k, k_norm, self.eps)), v


# -- the residual add between two norms ---------------------------------------------------


class AddNorm:
    """``cuda_norms``' kernel for bfloat16 rows of ``hidden`` in ``form`` (default the
    module's), launched as ``cuda_norms.fused_add_norm`` does."""

    def __init__(self, hidden: int, eps: float, form: str | None = None):
        self.hidden, self.eps = hidden, eps
        threads = cuda_norms.THREADS
        self.lib = build(f"""#include "cuda_emulator.h"
{cuda_norms.BLOCK_SUM}
{kernel_constant("EPS", eps)[0]}
template <typename T, int H, int THREADS>
void add_norm(const T* x, const T* r, const T* w_after, const T* w_next, T* h, T* n) {{
{cuda_norms.source(form or cuda_norms.FORM)}
}}
extern "C" void run(const void* x, const void* r, int rows, const void* w_after, const void* w_next, void* h,
                    void* n) {{
  launch({{(unsigned)rows, 1, 1}}, {{{threads}, 1, 1}}, [&] {{
    add_norm<{BF16}, {hidden}, {threads}>((const {BF16}*)x, (const {BF16}*)r, (const {BF16}*)w_after,
                                          (const {BF16}*)w_next, ({BF16}*)h, ({BF16}*)n); }});
}}
""")

    def __call__(self, x, r, w_after, w_next) -> tuple[np.ndarray, np.ndarray]:
        """(h, n) bfloat16 bits, (rows, hidden) each."""
        x, r = np.ascontiguousarray(x), np.ascontiguousarray(r)
        h, n = (np.zeros(x.shape, np.uint16) for _ in range(2))
        self.lib.run(_ptr(x), _ptr(r), ctypes.c_int(x.shape[0]), _ptr(np.ascontiguousarray(w_after)),
                     _ptr(np.ascontiguousarray(w_next)), _ptr(h), _ptr(n))
        return h, n

    def reference(self, x, r, w_after, w_next) -> tuple[np.ndarray, np.ndarray]:
        """The same in float64 (from the bfloat16 inputs)."""
        h = from_bf16(x).astype(np.float64) + rms_norm64(from_bf16(r).astype(np.float64), w_after, self.eps)
        return h, rms_norm64(h, w_next, self.eps)
