"""Which of a decode step's operations give a row other bits in a batch than alone, on
this device.

The promise is that a request gets the same tokens batched as alone. On the CPU the
parity suite proves it on every commit. On CUDA, ``bench/decode_step.py --check 8
--engine-alone`` found rows that differ (``bench/results/gpu-h100-fused-norms``). This
runs each piece of the family's engine decode step on the model's own weights, for M
rows at once and for each row alone, and compares the rows bit for bit:

- the projections (fused q/k/v, output, fused gate/up, down, the output layer);
- RMSNorm, rotary embedding with per-row positions;
- a prefill pass of several prompts shared against each prompt alone: the logits and
  the first layer's keys.

    python bench/batch_invariance.py --model DIR [--rows 1,2,8,64,128]

Each line reads: the piece, then for each M the rows (of the first eight) whose bits
differ from alone; "same" when none do.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from mlx_vlm import load

from vlm_serve.engine.families import family_for
from vlm_serve.engine.prefill import prefill_pass


def differing_rows(batched: mx.array, alone: list[mx.array]) -> list[int]:
    """Rows of ``batched`` whose bits differ from ``alone[i]`` (each a batch of one)."""
    # NaN equals NaN here: a random fixture's table may hold one, alike in both.
    return [i for i, one in enumerate(alone) if not mx.array_equal(batched[i], one[0], equal_nan=True).item()]


def invariance(fn, sizes: list[int]) -> dict[int, list[int]]:
    """For each M: which of the first eight rows of ``fn(0, M)`` (rows 0 to M of the
    inputs) differ from ``fn(i, i + 1)``."""
    shown = min(8, max(sizes))
    alone = [fn(i, i + 1) for i in range(shown)]
    mx.eval(alone)
    out = {}
    for m in sizes:
        batched = fn(0, m)
        mx.eval(batched)
        out[m] = differing_rows(batched, alone[:min(m, shown)])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rows", default="1,2,8,64,128")
    p.add_argument("--prompt-tokens", type=int, default=64)
    args = p.parse_args()
    sizes = [int(x) for x in args.rows.split(",")]
    model, _ = load(args.model)
    family = family_for(model)
    decoder = family.decoder_class(model) if family.decoder_class else None
    if decoder is None or not hasattr(decoder, "layers"):
        raise SystemExit(f"{family.name}: no engine decode step to take apart")
    layer = decoder.layers[0]
    lm = model.language_model
    norm = lm.model.norm.weight  # the embedding table may be quantized (packed)
    dtype, hidden = norm.dtype, norm.shape[0]
    key = mx.random.key(0)
    rows = max(sizes)

    def normal(*shape):
        return mx.random.normal(shape, key=mx.random.split(key, 7)[len(shape)]).astype(dtype)

    x = normal(rows, hidden)
    results = {}
    for name in ("qkv", "o_proj", "gate_up", "down_proj"):
        proj = getattr(layer, name, None)
        if proj is None:
            continue
        width = _input_width(proj)
        inputs = x if width == hidden else normal(rows, width)
        results[f"projection {name}"] = invariance(lambda a, b, f=proj, v=inputs: f(v[a:b]), sizes)
    results["output layer"] = invariance(lambda a, b: decoder.head(x[a:b]), sizes)
    weight = mx.ones((hidden,), dtype)
    results["rms_norm"] = invariance(lambda a, b: mx.fast.rms_norm(x[a:b], weight, 1e-6), sizes)
    attn = layer.attn
    q = normal(rows, attn.n_heads, 1, decoder.head_dim)
    positions = mx.arange(rows, dtype=mx.int32) * 7 + 100
    results["rope, per-row positions"] = invariance(
        lambda a, b: attn.rope(q[a:b], offset=positions[a:b]), sizes)
    results["prefill pass (logits)"], results["prefill pass (layer 0 keys)"] = _prefill(
        model, family, args.prompt_tokens, [m for m in sizes if m <= 8] or [1])
    for name, per_size in results.items():
        cells = ", ".join(f"M={m}: {'same' if not bad else bad}" for m, bad in per_size.items())
        print(f"{name:28s} {cells}")
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                      "results": {k: {str(m): v for m, v in r.items()} for k, r in results.items()}}))


def _input_width(proj) -> int:
    """The input features of a ``StepLinear``'s layer (plain: its weight's columns;
    quantized: its scales, one per group of inputs)."""
    module = proj.module
    if "scales" in module:
        return module.scales.shape[-1] * module.group_size
    return module.weight.shape[-1]


def _prefill(model, family, length: int, sizes: list[int]) -> tuple[dict, dict]:
    """Prompts of one length in one pass against each alone, on fresh caches."""
    lm = model.language_model
    ids = mx.random.randint(10, 1000, (max(sizes), length), key=mx.random.key(1))

    def run(rows: mx.array) -> tuple[mx.array, mx.array]:
        cache = lm.make_cache()
        logits, _ = prefill_pass(model, family, rows, lm.model.embed_tokens(rows), cache, {})
        return logits, cache[0].state[0][..., :length, :]

    alone = [run(ids[i:i + 1]) for i in range(min(8, ids.shape[0]))]
    mx.eval(alone)
    logits, keys = {}, {}
    for m in sizes:
        shared = run(ids[:m])
        mx.eval(shared)
        logits[m] = differing_rows(shared[0], [a[0] for a in alone[:m]])
        keys[m] = differing_rows(shared[1], [a[1] for a in alone[:m]])
    return logits, keys


if __name__ == "__main__":
    main()
