"""Decode steps of one tensor-parallel rank (or of one process), for TP=1 against TP=N.

    python bench/tp_step.py --model DIR --batch-sizes 1,32,64 --out tp1.json
    mlx.launch --backend nccl -n 2 -- python bench/tp_step.py --model DIR --out tp2.json

Each rank loads the model (lazily; a model directory written by
``vlm_serve.distributed.random_weights`` draws this rank's shard in memory), shards its
language model across the group exactly as the server does, and times per batch size:

- ``plain_ms``: mlx-vlm's model code with the same split (its own caches, equal rows):
  the plain forward of the split model;
- ``engine_ms``: the engine's decode step (slot store, fused and compiled), ragged rows;
- ``engine_host_ms``: of that, the time the host spends building and dispatching the
  step (Python and MLX's graph and kernel launches). Near ``engine_ms``: the step is
  bound by the host, and a second GPU shortens only the device's share.

Every rank runs the same steps (the group's all-reduces must match); rank 0 writes the
JSON and prints one line per batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
from step_breakdown import build_engine_batch, plain_step  # noqa: E402

from vlm_serve.distributed.random_weights import fill_random_if_unwritten  # noqa: E402
from vlm_serve.distributed.shard import parameter_bytes, shard_language_model  # noqa: E402
from vlm_serve.engine import loader  # noqa: E402


def engine_step(model, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(wall ms, host ms) per step of the engine's decode step."""
    engine_batch = build_engine_batch(model, batch, context, steps + 8, ragged=True, use_decoder=True)
    for _ in range(3):
        mx.eval(engine_batch.step().tokens)
    host = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        tokens = engine_batch.step().tokens
        mx.async_eval(tokens)
        host += time.perf_counter() - t
    mx.eval(tokens)
    wall = time.perf_counter() - start
    return 1000 * wall / steps, 1000 * host / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", default="1,32,64")
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--no-plain", action="store_true", help="only the engine's step")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    group = mx.distributed.init()  # a group of one without a launcher
    rank, size = group.rank(), group.size()
    mx.random.seed(0)  # the plain forward's random prompts: the same on every rank
    started = time.perf_counter()
    loaded = loader.load(args.model, lazy=size > 1)
    if size > 1:
        shard_language_model(loaded.model, group)
        fill_random_if_unwritten(loaded, rank)
        mx.eval(loaded.model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0)))  # every rank loaded
    result = {
        "model": args.model, "tensor_parallel": size, "context": args.context,
        "device": str(mx.default_device()), "load_s": round(time.perf_counter() - started, 1),
        "weights_gb_per_rank": round(parameter_bytes(loaded.model) / 1e9, 2), "steps": [],
    }
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        row = {"batch": batch}
        if not args.no_plain:
            row["plain_ms"] = round(plain_step(loaded.model, batch, args.context, args.steps), 3)
        row["engine_ms"], row["engine_host_ms"] = (
            round(v, 3) for v in engine_step(loaded.model, batch, args.context, args.steps))
        row["engine_tokens_per_s"] = round(1000 * batch / row["engine_ms"], 1)
        result["steps"].append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        mx.clear_cache()
    if rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "steps"}))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
