"""Decode attention of 34 layers (Gemma-3-4B heads: 8 query, 4 key/value, dim 256, bf16)
at B rows of ~330-360 keys in a store of 512 columns: the engine's CUDA kernels against
MLX's own single-query kernel on rows of one length (352 keys), and the step's 68 KV
writes (``put_along_axis`` into the store, in place). ``--prefill-lengths``: one first
prefill pass of each length through 34 layers, the engine's prefill kernel at 1, 2, 4
and 8 queries per block (and whether each gives the bits of 1) and its tensor-core
kernel over all of a query's columns a block or chunks of 256 or 512, against MLX's
causal attention. ``--cached N``: those passes go on from N keys already in the cache
(a chat's next turn), where the tensor-core kernel without chunks has the fewest
blocks. ``--prefill-dim 512``: those passes with Gemma 4's widest heads. CUDA only.

    python bench/attention_kernels.py [--batch-sizes 1,64,128] [--prefill-lengths 270,2048]
    python bench/attention_kernels.py --batch-sizes "" --prefill-lengths 16,64,256 --cached 2048
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from vlm_serve.engine.decode.cuda_attention import (
    decode_attention,
    flash_prefill_attention,
    heads_per_block,
    prefill_attention,
    queries_in_shared_memory,
)

LAYERS, HEADS, KV_HEADS, DIM, COLUMNS, SCALE = 34, 8, 4, 256, 512, 0.0625


def timed(step, reps: int = 20) -> float:
    for _ in range(3):
        mx.eval(step())
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(step())
    return 1e3 * (time.perf_counter() - start) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,64,128")
    p.add_argument("--prefill-lengths", default="")
    p.add_argument("--cached", type=int, default=0, help="keys already cached before each pass")
    p.add_argument("--prefill-dim", type=int, default=DIM,
                   help="head size of the prefill passes (512: Gemma 4's full-attention layers)")
    args = p.parse_args()
    bf16 = mx.bfloat16
    for length in (int(n) for n in args.prefill_lengths.split(",") if n):
        prefill(length, args.cached, args.prefill_dim)
    for rows in (int(b) for b in args.batch_sizes.split(",") if b):
        def store():
            return [mx.random.normal((rows, KV_HEADS, COLUMNS, DIM)).astype(bf16) for _ in range(LAYERS)]

        q = [mx.random.normal((rows, HEADS, 1, DIM)).astype(bf16) for _ in range(LAYERS)]
        keys, values = store(), store()
        counts = mx.array([330 + (i * 7) % 31 for i in range(rows)], mx.int32)
        mx.eval(q, keys, values, counts)
        ours = timed(lambda: [decode_attention(q[i], keys[i], values[i], counts, SCALE) for i in range(LAYERS)])
        k352, v352 = [k[:, :, :352] for k in keys], [v[:, :, :352] for v in values]
        mx.eval(k352, v352)
        mlx_ms = timed(lambda: [mx.fast.scaled_dot_product_attention(q[i], k352[i], v352[i], scale=SCALE)
                                for i in range(LAYERS)])
        column = mx.broadcast_to(mx.full((rows, 1, 1, 1), 340, mx.int32), (rows, KV_HEADS, 1, DIM))
        new = mx.ones((rows, KV_HEADS, 1, DIM), bf16)

        def write():
            for i in range(LAYERS):
                keys[i] = mx.put_along_axis(keys[i], column, new, axis=2)
                values[i] = mx.put_along_axis(values[i], column, new, axis=2)
            return keys + values

        writes = timed(write)
        print(f"B={rows}: engine kernels {ours:.2f} ms, MLX single-query kernel {mlx_ms:.2f} ms, "
              f"68 KV writes {writes:.2f} ms", flush=True)


def prefill(length: int, cached: int = 0, dim: int = DIM) -> None:
    """A pass of ``length`` tokens after ``cached`` keys: 34 layers' attention, ms."""
    def layer_inputs(heads, columns):
        return [mx.random.normal((1, heads, columns, dim)).astype(mx.bfloat16) for _ in range(LAYERS)]

    q = layer_inputs(HEADS, length)
    keys, values = layer_inputs(KV_HEADS, cached + length), layer_inputs(KV_HEADS, cached + length)
    mx.eval(q, keys, values)
    cells, one = [], None
    most = queries_in_shared_memory(heads_per_block(HEADS, KV_HEADS, dim), dim)
    for queries in [n for n in (1, 2, 4, 8) if n <= most]:
        def run(n=queries):
            return [prefill_attention(q[i], keys[i], values[i], SCALE, queries=n) for i in range(LAYERS)]

        ms = timed(run, reps=5)
        out = run()[0]
        one = out if one is None else one
        same = mx.array_equal(out, one).item()
        cells.append(f"{queries} a block {ms:.2f} ms{'' if same else ' (OTHER BITS)'}")
    flash = []
    for chunk in (0, 256, 512):
        ms = timed(lambda c=chunk: [flash_prefill_attention(q[i], keys[i], values[i], SCALE, chunk=c)
                                    for i in range(LAYERS)], reps=5)
        flash.append(f"{chunk or 'all'} columns a block {ms:.2f} ms")
    mlx_ms = timed(lambda: [mx.fast.scaled_dot_product_attention(q[i], keys[i], values[i], scale=SCALE,
                                                                  mask="causal") for i in range(LAYERS)], reps=5)
    after = (f" after {cached}" if cached else "") + (f", head size {dim}" if dim != DIM else "")
    print(f"prefill {length} tokens{after}: engine kernel " + ", ".join(cells)
          + "; tensor-core kernel " + ", ".join(flash) + f"; MLX {mlx_ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
