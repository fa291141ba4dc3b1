"""Plain decode steps of a model in bf16 and 4-bit at several batch sizes, each in its
own process (a dead CUDA context ends only that probe), one JSON line per probe.

    python bench/gpu/probe_quantized.py --preset gemma3-4b --batches 1,8,16,32,64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def probe(model_dir: str, batch: int, context: int, steps: int) -> None:
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.models import cache as vlm_cache

    model, _ = load(model_dir)
    lm = model.language_model
    cache = vlm_cache.make_prompt_cache(lm)
    mx.eval(lm.model(mx.random.randint(10, 1000, (batch, context)), cache=cache))
    y = mx.zeros((batch, 1), mx.int32)
    for i in range(steps + 3):
        if i == 3:
            mx.eval(y)
            start = time.perf_counter()
        y = mx.argmax(lm(y, cache=cache).logits[:, -1, :], axis=-1)[:, None].astype(mx.int32)
        mx.async_eval(y)
    mx.eval(y)
    ms = 1000 * (time.perf_counter() - start) / steps
    print(json.dumps({"step_ms": round(ms, 2), "tok_s": round(batch * 1000 / ms, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gemma3-4b")
    parser.add_argument("--arch", default="gemma3")
    parser.add_argument("--batches", default="1,8,16,32,64")
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", default=None)
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.probe, args.batch, args.context, args.steps)
        return
    from fixtures.build import build_model, quantize_model

    bf16 = Path(f"/tmp/vlm-bench-{args.preset}")
    if not (bf16 / "config.json").exists():
        build_model(args.arch, bf16, preset=args.preset)
    q4 = Path(f"/tmp/vlm-bench-{args.preset}-q4")
    if not (q4 / "config.json").exists():
        quantize_model(bf16, q4, bits=4)
    results = []
    for name, model_dir in (("bf16", bf16), ("q4", q4)):
        for batch in (int(b) for b in args.batches.split(",")):
            proc = subprocess.run(
                [sys.executable, __file__, "--probe", str(model_dir), "--batch", str(batch),
                 "--context", str(args.context), "--steps", str(args.steps)],
                capture_output=True, text=True, timeout=600,
            )
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            result = {"weights": name, "batch": batch, "rc": proc.returncode}
            try:
                result.update(json.loads(lines[-1]))
            except (IndexError, json.JSONDecodeError):
                result["tail"] = lines[-3:]
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
