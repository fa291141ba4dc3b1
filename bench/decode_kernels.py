"""Two parts of the engine's CUDA decode step, each way it may run.

- Decode attention: with a lane's loads in flight (``cuda_attention.KEY_LOADS``/
  ``VALUE_LOADS``) or one at a time; with its keys and values copied into shared memory
  asynchronously (``--pipeline``: ``cuda_attention.PIPELINE``); or with its columns split
  another way among blocks and warps (``--split``).
- A padded pass's zero rows: by the engine's kernel (``padded_matmul.pad_rows``) or by
  MLX's ``pad``.

``--part attention`` / ``--part pad`` run one of them 34 times between the CUDA
profiler's start and stop, for ncu's GPU time per kernel. The shapes are the
Gemma-3-4B shape's layers: 8 query heads, 4 key/value heads of 256, bf16, B rows of ~580
keys in a store of 640 columns; a down projection's 64 rows of 10,240 padded to 320.
``--part steps`` times the whole compiled decode step of ``--model`` at 64 ragged rows:
the old ways, the defaults and ``--pipeline`` (default 0: each lane's own loads),
alternating in one process. CUDA only.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --print-summary per-kernel \\
        --csv python bench/decode_kernels.py --part attention --loads 1,1 > attention.csv
    python bench/step_kernels.py --summarize attention.csv
    python bench/decode_kernels.py --part steps --model DIR --context 480
"""

from __future__ import annotations

import argparse
import os
import sys

import mlx.core as mx

from vlm_serve.engine import padded_matmul
from vlm_serve.engine.decode import cuda_attention

sys.path.insert(0, os.path.dirname(__file__))
from step_kernels import profiled  # noqa: E402

LAYERS = 34


def attention(rows: int) -> None:
    columns = 640
    q = [mx.random.normal((rows, 8, 1, 256)).astype(mx.bfloat16) for _ in range(LAYERS)]
    keys, values = ([mx.random.normal((rows, 4, columns, 256)).astype(mx.bfloat16) for _ in range(LAYERS)]
                    for _ in range(2))
    counts = mx.array([560 + (i * 7) % 41 for i in range(rows)], mx.int32)
    mx.eval(q, keys, values, counts)
    profiled(lambda: [cuda_attention.decode_attention(q[i], keys[i], values[i], counts, 0.0625)
                       for i in range(LAYERS)])


def pad() -> None:
    x = mx.random.normal((64, 10240)).astype(mx.bfloat16)
    mx.eval(x)
    # Each pass's rows a product of their own, as each layer's are.
    profiled(lambda: [padded_matmul.pad_rows(x * (1 + i), 320) for i in range(LAYERS)])


def steps(model_dir: str, context: int, rounds: int, pipeline: int) -> None:
    from decode_step import engine_step
    from mlx_vlm import load

    from vlm_serve.engine.families import family_for

    model, _ = load(model_dir)
    loads, default_pipeline = (cuda_attention.KEY_LOADS, cuda_attention.VALUE_LOADS), cuda_attention.PIPELINE
    ways = {"loads 1,1 and MLX's pad": (1, 1, False, 0),
            "defaults": (*loads, True, default_pipeline),
            f"PIPELINE={pipeline}": (*loads, True, pipeline)}
    for n in range(rounds):
        for name, (key_loads, value_loads, pad_kernel, stages) in ways.items():
            cuda_attention.KEY_LOADS, cuda_attention.VALUE_LOADS = key_loads, value_loads
            cuda_attention.PIPELINE = stages
            padded_matmul.PAD_KERNEL = pad_kernel
            family_for(model)._decoder = None  # a step compiled anew for each way
            print(f"round {n}, {name}: {engine_step(model, 64, context, 48, True):.3f} ms a step", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("attention", "pad", "steps"), required=True)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--loads", default=None, help="attention: a lane's key and value loads in flight, e.g. 1,1")
    p.add_argument("--split", default=None,
                   help="attention: pass 1's columns per block and warps per block, e.g. 128,4 "
                        "(a row's bits follow them; default the module's)")
    p.add_argument("--pipeline", type=int, default=None,
                   help="attention: stages of asynchronous copies (0: each lane's own loads; default the "
                        "module's); steps: the third way's (default 0)")
    p.add_argument("--mlx-pad", action="store_true", help="pad: MLX's pad, not the engine's kernel")
    p.add_argument("--model")
    p.add_argument("--context", type=int, default=480)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    if args.loads:
        cuda_attention.KEY_LOADS, cuda_attention.VALUE_LOADS = (int(n) for n in args.loads.split(","))
    if args.pipeline is not None and args.part == "attention":
        cuda_attention.PIPELINE = args.pipeline
    if args.split:
        cuda_attention.DECODE_CHUNK, cuda_attention.DECODE_WARPS = (int(n) for n in args.split.split(","))
    padded_matmul.PAD_KERNEL = not args.mlx_pad
    if args.part == "attention":
        attention(args.rows)
    elif args.part == "pad":
        pad()
    else:
        steps(args.model, args.context, args.rounds, args.pipeline or 0)


if __name__ == "__main__":
    main()
