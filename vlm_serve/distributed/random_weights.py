"""Benchmark models too large to write: random weights made in memory, per rank.

A Qwen2.5-VL-72B-shaped model in bf16 is ~145 GB, more than a benchmark machine's disk
and than one GPU. Its directory holds everything but weights (config, tokenizer,
processor and chat template, written by the fixture builder's own family modules) and
an ``unwritten.json`` naming the preset. Loading builds the model lazily from the
config; a tensor-parallel rank shards it first and only then draws its weights, at the
sharded shapes, so no rank ever holds more than its own part:

    python -m vlm_serve.distributed.random_weights --arch qwen2_5_vl --preset qwen2_5_vl-72b --out /tmp/q72
    vlm-serve --model /tmp/q72 --tensor-parallel 2

Replicated weights (embeddings, norms, the vision tower) are drawn from the same key on
every rank, so the ranks hold the same model; a sharded weight's key also names the
rank. Values follow the fixture's init rule at the unsharded shape (a sharded layer's
scale is the full layer's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

MARKER = "unwritten.json"

# Presets that exist only unwritten (the fixture families keep the ones small enough to
# write); each names its fixture family. Shapes of Qwen/Qwen2.5-VL-72B-Instruct.
PRESETS = {
    "qwen2_5_vl-72b": ("qwen2_5_vl", dict(
        dtype="bfloat16",
        vocab_size=152064,
        dims=dict(
            hidden=8192, intermediate=29568, layers=80, heads=64, kv_heads=8,
            mrope_section=[16, 24, 24],
            v_hidden=1280, v_intermediate=3456, v_depth=32, v_heads=16,
            window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
            min_pixels=3136, max_pixels=12845056,
        ),
    )),
}

# Parameters that tensor parallelism splits (see shard.py): their values differ per rank.
_SHARDED = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.")


def _preset(arch: str, name: str):
    from vlm_serve.fixtures import base
    from vlm_serve.fixtures.build import FAMILIES

    if name in PRESETS:
        owner, fields = PRESETS[name]
        if owner != arch:
            raise ValueError(f"preset {name} is a {owner} preset, not {arch}")
        return base.Preset(**fields)
    return FAMILIES[arch].PRESETS[name]


def write_unwritten(arch: str, preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """A model directory without weights, as the fixture builder writes one with."""
    from vlm_serve.fixtures.base import write_json
    from vlm_serve.fixtures.build import write_model_files

    out, _, p, _ = write_model_files(arch, out_dir, _preset(arch, preset))
    write_json(out / MARKER, {"arch": arch, "preset": preset, "seed": seed, "dtype": p.dtype})
    return out


def _marker(path: Path) -> dict | None:
    file = Path(path) / MARKER
    return json.loads(file.read_text()) if file.exists() else None


def load_unwritten(path: Path, lazy: bool = False):
    """(model, processor) for an unwritten model directory; None for anything else.
    ``lazy``: the weights are left to ``fill_random_if_unwritten`` (after sharding)."""
    info = _marker(path)
    if info is None:
        return None
    from mlx_vlm.utils import load_image_processor, load_processor

    from vlm_serve.fixtures.weights import instantiate

    config = json.loads((Path(path) / "config.json").read_text())
    model = instantiate(config)  # lazy: default-initialised arrays nobody evaluates
    model.eval()
    processor = load_processor(path, True, eos_token_ids=config.get("eos_token_id"))
    image_processor = load_image_processor(path)
    if image_processor is not None:
        processor.image_processor = image_processor
    if not lazy:
        _fill(model, path, info, rank=0)
    return model, processor


def fill_random_if_unwritten(loaded, rank: int) -> None:
    """Draw this rank's weights if the loaded model has none (after sharding)."""
    info = _marker(loaded.path)
    if info is not None:
        _fill(loaded.model, loaded.path, info, rank)


def _fill(model, path: Path, info: dict, rank: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from vlm_serve.fixtures.build import FAMILIES
    from vlm_serve.fixtures.weights import DTYPES, parameter_shapes

    config = json.loads((Path(path) / "config.json").read_text())
    full_shapes = parameter_shapes(config)
    rule = FAMILIES[info["arch"]].init_rule(_preset(info["arch"], info["preset"]))
    dtype = DTYPES[info["dtype"]]
    params = []
    for name, value in tree_flatten(model.parameters()):
        spec = rule(name, full_shapes.get(name, tuple(value.shape)))
        if spec == "zeros":
            new = mx.zeros(value.shape, dtype)
        elif spec == "ones":
            new = mx.ones(value.shape, dtype)
        else:
            tag = f"{info['seed']}:{name}:{rank if _SHARDED.search(name) else ''}"
            key = mx.random.key(int.from_bytes(hashlib.sha256(tag.encode()).digest()[:4], "little"))
            new = mx.random.normal(value.shape, dtype, key=key) * float(spec)
        params.append((name, new))
        if len(params) % 64 == 0:
            mx.eval([p for _, p in params[-64:]])  # bounded memory while drawing
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a model directory whose weights are drawn at load.")
    parser.add_argument("--arch", required=True)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_unwritten(args.arch, args.preset, args.out, args.seed))


if __name__ == "__main__":
    main()
