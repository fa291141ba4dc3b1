"""Find which op of the Qwen2.5-VL vision tower kills the process on a GPU.

Each probe runs in its own subprocess (a crash such as SIGFPE ends only that probe) at
the 7B checkpoint's vision shapes with random weights, and prints one JSON line per
probe: its name, exit code and the tail of its output.

    python bench/gpu/probe_qwen_vision.py [--sizes 224,448] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROBES = {
    # name: (dtype of weights, dtype of pixels, what runs)
    "conv3d-bf16": ("bfloat16", "bfloat16", "conv"),
    "conv3d-f32": ("float32", "float32", "conv"),
    "conv3d-bf16-as-matmul": ("bfloat16", "bfloat16", "conv-matmul"),
    "sdpa-bf16": ("bfloat16", "bfloat16", "sdpa"),
    "tower-bf16": ("bfloat16", "bfloat16", "tower"),
    "tower-f32": ("float32", "float32", "tower"),
    "tower-bf16-skip-empty-windows": ("bfloat16", "bfloat16", "tower-unique"),
    "sdpa-bf16-empty": ("bfloat16", "bfloat16", "sdpa-empty"),
    "sdpa-f32-empty": ("float32", "float32", "sdpa-empty"),
    "sdpa-bf16-strided": ("bfloat16", "bfloat16", "sdpa-strided"),
    "trace-bf16": ("bfloat16", "bfloat16", "trace"),
}


def vision_config():
    from mlx_vlm.models.qwen2_5_vl.config import VisionConfig

    return VisionConfig(
        model_type="qwen2_5_vl", depth=32, hidden_size=1280, intermediate_size=3420,
        out_hidden_size=3584, num_heads=16, patch_size=14, spatial_patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    )


def run_probe(kind: str, wdtype: str, pdtype: str, size: int) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.models.qwen2_5_vl.vision import VisionModel

    wd, pd = getattr(mx, wdtype), getattr(mx, pdtype)
    grid = size // 14
    patches = grid * grid
    pixels = mx.random.normal((patches, 3 * 2 * 14 * 14)).astype(pd)
    if kind in ("conv", "conv-matmul"):
        conv = nn.Conv3d(3, 1280, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False)
        conv.set_dtype(wd)
        x = pixels.reshape(-1, 3, 2, 14, 14).moveaxis(1, 4)
        if kind == "conv":
            y = conv(x)
        else:  # kernel == stride: the conv is one matmul over flattened patches
            y = x.reshape(patches, -1) @ conv.weight.reshape(1280, -1).T
        mx.eval(y)
        print("ok", y.shape, y.dtype)
        return
    if kind == "sdpa":
        for length in (64, patches):
            q = mx.random.normal((1, 16, length, 80)).astype(pd)
            mx.eval(mx.fast.scaled_dot_product_attention(q, q, q, scale=80 ** -0.5))
        print("ok")
        return
    if kind == "sdpa-empty":  # a zero-length window
        q = mx.zeros((1, 16, 0, 80)).astype(pd)
        mx.eval(mx.fast.scaled_dot_product_attention(q, q, q, scale=80 ** -0.5))
        print("ok")
        return
    if kind == "sdpa-strided":
        # q, k, v as the tower makes them: views of one qkv projection, split in windows
        qkv = mx.random.normal((patches, 3, 16, 80)).astype(pd).transpose(1, 0, 2, 3)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in mx.split(qkv, 3))
        for qs, ks, vs in zip(*(mx.split(t, [64], axis=2) for t in (q, k, v))):
            mx.eval(mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=80 ** -0.5))
        print("ok")
        return
    model = VisionModel(vision_config())
    model.set_dtype(wd)
    if kind == "trace":
        trace(model, pixels, mx.array([[1, grid, grid]]))
        return
    if kind == "tower-unique":
        from vlm_serve.engine.families import qwen_tower

        qwen_tower.install(model)  # windows without repeated bounds, indices on the host
    grid_thw = mx.array([[1, grid, grid]])
    y = model(pixels, grid_thw, output_hidden_states=False)
    mx.eval(y)
    print("ok", y.shape, y.dtype, bool(mx.isfinite(y.astype(mx.float32)).all().item()))


def trace(model, pixels, grid_thw) -> None:
    """The tower's first blocks op by op, evaluating and printing each step, so the
    last line printed before a crash names the op."""
    import mlx.core as mx
    from mlx_vlm.models.qwen2_5_vl.vision import apply_rotary_pos_emb_vision

    def step(name, *arrays):
        mx.eval(*arrays)
        print(name, [(a.shape, a.dtype) for a in arrays], flush=True)
        return arrays[0] if len(arrays) == 1 else arrays

    h = step("patch_embed", model.patch_embed(pixels))
    rot = step("rot_pos_emb", model.rot_pos_emb(grid_thw))
    window_index, cu_window = model.get_window_index(grid_thw)
    step("window_index", window_index, cu_window)
    n = h.shape[0]
    cu_full = mx.array([0, n])
    unit = model.spatial_merge_unit
    h = step("window_gather", h.reshape(n // unit, unit, -1)[window_index].reshape(n, -1))
    rot = step("rot_gather", rot.reshape(n // unit, unit, -1)[window_index].reshape(n, -1))
    for i, blk in enumerate(model.blocks):
        attn = blk.attn
        x = step(f"b{i}.norm1", blk.norm1(h))
        qkv = step(f"b{i}.qkv", attn.qkv(x).reshape(n, 3, attn.num_heads, -1).transpose(1, 0, 2, 3))
        q, k, v = mx.split(qkv, 3)
        q = step(f"b{i}.rope_q", apply_rotary_pos_emb_vision(mx.expand_dims(q, 0), rot)[0])
        k = step(f"b{i}.rope_k", apply_rotary_pos_emb_vision(mx.expand_dims(k, 0), rot)[0])
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        cuts = (cu_full if i in model.fullatt_block_indexes else cu_window)[1:-1].tolist()
        outs = []
        for j, (qs, ks, vs) in enumerate(zip(*(mx.split(t, cuts, axis=2) for t in (q, k, v)))):
            outs.append(step(f"b{i}.sdpa[{j}]", mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=attn.scale)))
        o = step(f"b{i}.proj", attn.proj(mx.concatenate(outs, axis=2).transpose(0, 2, 1, 3).reshape(n, -1)))
        h = step(f"b{i}.residual", h + o)
        h = step(f"b{i}.mlp", h + blk.mlp(blk.norm2(h)))
    h = step("merger", model.merger(h))
    step("unwindow", h[mx.argsort(window_index, axis=0)])
    print("ok")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="224,448")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="comma-separated probe names")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=224, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        w, p, kind = PROBES[args.probe]
        run_probe(kind, w, p, args.size)
        return
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        for name in PROBES:
            if args.only and name not in args.only.split(","):
                continue
            proc = subprocess.run(
                [sys.executable, __file__, "--probe", name, "--size", str(size)],
                capture_output=True, text=True, timeout=300,
            )
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-4:]
            result = {"probe": name, "size": size, "rc": proc.returncode, "tail": tail}
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
