"""Graph nodes of one decode step: mlx-vlm's plain forward against the engine's batch step
(through the model code on mlx-lm's batch caches, and through the family's own decode
step where it has one).

On MLX the decode step is paid per graph node on the host, so nodes per step is the
engine's currency. Counts come from ``mx.export_to_dot`` on each step's outputs. On the
CPU the fast ops (RMSNorm, RoPE, SDPA) appear decomposed: use the GPU for absolute numbers
and the CPU for differences.

    python bench/count_nodes.py --model DIR [--batch 16] [--context 64] [--out nodes.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile

import mlx.core as mx
from mlx_vlm import load
from mlx_vlm.models import cache as vlm_cache

from step_breakdown import build_engine_batch, id_limit  # noqa: E402 - run from bench/ or with it on the path


def count(*outputs) -> collections.Counter:
    """Primitive name -> number of nodes in the graph that computes ``outputs``."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        labels = re.findall(r'label ="([^"]+)"', f.read())
    return collections.Counter(labels)


def plain_step_nodes(model, batch: int, context: int) -> collections.Counter:
    lm = model.language_model
    cache = vlm_cache.make_prompt_cache(lm)
    mx.eval(lm.model(mx.random.randint(10, id_limit(model), (batch, context)), cache=cache))
    mx.eval([c.state for c in cache])
    kwargs = {}
    if hasattr(lm, "get_rope_index"):  # mRoPE: text positions on all three axes
        kwargs["position_ids"] = mx.full((3, batch, 1), context, mx.int32)
    logits = lm(mx.zeros((batch, 1), mx.int32), cache=cache, **kwargs).logits[:, -1, :]
    return count(mx.argmax(logits, axis=-1))


def engine_step_nodes(model, batch: int, context: int, use_decoder: bool) -> collections.Counter:
    engine_batch = build_engine_batch(
        model, batch, context, max_tokens=64, ragged=True, use_decoder=use_decoder
    )
    if engine_batch.store is None and use_decoder:
        return collections.Counter()  # this family has no decode step of its own
    held = engine_batch.store.keys + engine_batch.store.values if engine_batch.store else [
        c.state for c in engine_batch.cache
    ]
    mx.eval(engine_batch.next_tokens, held)
    return count(engine_batch.step().tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, _ = load(args.model)
    layers = len(model.language_model.layers)
    result = {"device": str(mx.default_device()), "batch": args.batch, "layers": layers}
    counters = {
        "plain": lambda: plain_step_nodes(model, args.batch, args.context),
        "model_code": lambda: engine_step_nodes(model, args.batch, args.context, False),
        "engine": lambda: engine_step_nodes(model, args.batch, args.context, True),
    }
    for name, fn in counters.items():
        nodes = fn()
        total = sum(nodes.values())
        result[name] = {"nodes": total, "per_layer": round(total / layers, 1),
                        "top": dict(nodes.most_common(12))}
        print(f"{name:10s} {total:6d} nodes ({total / layers:.1f} per layer)  {dict(nodes.most_common(6))}")
    for name in ("model_code", "engine"):
        result[f"{name}_ratio"] = round(result[name]["nodes"] / result["plain"]["nodes"], 3)
        print(f"{name} / plain: {result[f'{name}_ratio']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
