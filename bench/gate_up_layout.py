"""Gemma's MLP input, two ways: the fused gate/up projection split into strided halves
(the engine's layout today) against one batched matmul over a (2, hidden, intermediate)
weight, whose two outputs are each contiguous, both followed by the engine's fused
GELU-times-up kernel. Under ncu that kernel ran at ~0.9 TB/s on the strided halves of a
7 x 288 prefill pass (H200, Gemma-3-4B shape): this times both layouts, the kernel alone
on strided and on contiguous inputs, and checks that both layouts give the same bits.

    python bench/gate_up_layout.py [--tokens 2016] [--hidden 2560] [--intermediate 10240]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from vlm_serve.engine.decode.gemma3 import _gelu_times


def timed(fn, reps: int) -> float:
    """Milliseconds per call, calls queued back to back as the engine queues passes."""
    mx.eval(fn())
    start = time.perf_counter()
    outs = []
    for _ in range(reps):
        outs.append(fn())
        mx.async_eval(outs[-1])
    mx.eval(outs)
    return 1000 * (time.perf_counter() - start) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2016)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--intermediate", type=int, default=10240)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    n, h, i = args.tokens, args.hidden, args.intermediate
    x = (0.1 * mx.random.normal((n, h), key=mx.random.key(0))).astype(dtype)
    fused = (0.02 * mx.random.normal((h, 2 * i), key=mx.random.key(1))).astype(dtype)
    # The same weights as two stacked matrices: batch 0 is gate's columns, batch 1 up's.
    stacked = mx.contiguous(mx.stack([fused[:, :i], fused[:, i:]]))
    mx.eval(x, fused, stacked)

    def split_layout():
        gate, up = mx.split(x @ fused, 2, axis=-1)
        return _gelu_times(gate, up)

    def batched_layout():
        both = x[None] @ stacked  # (2, n, i): each half contiguous
        return _gelu_times(both[0], both[1])

    halves = mx.split(x @ fused, 2, axis=-1)
    whole = [mx.contiguous(a) for a in halves]
    mx.eval(halves, whole)
    result = {
        "device": str(mx.default_device()), "mlx": mx.__version__,
        "shape": {"tokens": n, "hidden": h, "intermediate": i, "dtype": args.dtype},
        "split layout ms": round(timed(split_layout, args.reps), 3),
        "batched layout ms": round(timed(batched_layout, args.reps), 3),
        "kernel on strided halves ms": round(timed(lambda: _gelu_times(*halves), args.reps), 3),
        "kernel on contiguous halves ms": round(timed(lambda: _gelu_times(*whole), args.reps), 3),
        "same bits": bool(mx.array_equal(split_layout(), batched_layout()).item()),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
