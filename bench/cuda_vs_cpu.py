"""Which of a model's layers computes something else on this machine's default device
than on the CPU, given the same inputs.

For finding the op behind a wrong answer on a GPU: one text prompt (and, with
``--image-size``, one image) runs through mlx-vlm's model code on the default device,
every leaf layer's inputs and output recorded; then each layer runs again on the CPU on
the same inputs, and the layers are printed in call order with the largest difference
from the CPU's output, relative to that output's largest magnitude (rounding gives
~1e-3 in bfloat16, ~1e-6 in float32). The last line names the first layer off by more
than ``--tolerance``, or with NaN where the CPU has none: the one to look at.

    python bench/cuda_vs_cpu.py --model DIR [--image-size 64] [--show 40]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_vlm import load
from mlx_vlm.prompt_utils import apply_chat_template
from PIL import Image

from vlm_serve.engine.quantized_check import relative_error


def leaf_layers(model: nn.Module) -> dict[int, str]:
    """id -> dotted name of every module with no modules below it."""
    named = dict(model.named_modules())
    parents = {name.rsplit(".", 1)[0] for name in named if "." in name}
    return {id(module): name for name, module in named.items() if name not in parents}


def record_calls(model: nn.Module, run) -> list[tuple[str, nn.Module, tuple, dict, mx.array]]:
    """Every leaf layer's call during ``run()``: (name, layer, args, kwargs, output)."""
    names = leaf_layers(model)
    calls = []
    patched = {}
    for cls in {type(m) for _, m in model.named_modules()}:
        original = cls.__call__

        def call(self, *args, __original=original, **kwargs):
            out = __original(self, *args, **kwargs)
            if id(self) in names and isinstance(out, mx.array):
                # New handles: the model code may update its arrays in place (h *= scale).
                calls.append((names[id(self)], self, tuple(map(handle, args)),
                              {k: handle(v) for k, v in kwargs.items()}, handle(out)))
            return out

        patched[cls] = original
        cls.__call__ = call
    try:
        run()
        mx.eval([c[4] for c in calls])
    finally:
        for cls, original in patched.items():
            cls.__call__ = original
    return calls


def handle(value):
    return mx.array(value) if isinstance(value, mx.array) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--image-size", type=int, default=0, help="one image of this many pixels a side")
    parser.add_argument("--prompt", default="Describe the weather in three short sentences.")
    parser.add_argument("--show", type=int, default=40, help="print the first N layers (and every NaN)")
    parser.add_argument("--tolerance", type=float, default=1e-2, help="relative difference that counts as off")
    args = parser.parse_args()

    model, processor = load(args.model)
    images = [Image.new("RGB", (args.image_size,) * 2, (90, 140, 200))] if args.image_size else None
    prompt = apply_chat_template(processor, model.config, args.prompt, num_images=len(images or []))
    inputs = processor(text=[prompt], images=images, return_tensors="np", padding=True)
    input_ids = mx.array(inputs["input_ids"])
    pixels = mx.array(inputs["pixel_values"]) if images else None
    mask = mx.array(inputs["attention_mask"])
    extra = {k: mx.array(v) for k, v in inputs.items()
             if k not in ("input_ids", "pixel_values", "attention_mask") and hasattr(v, "shape")}

    def forward():
        return model(input_ids, pixel_values=pixels, mask=mask, **extra)

    print(f"default device {mx.default_device()}, {args.model}")
    calls = record_calls(model, forward)
    shown, first_off = 0, None
    for name, layer, call_args, call_kwargs, out in calls:
        with mx.stream(mx.cpu):
            reference = layer(*call_args, **call_kwargs)  # MLX's arrays are on no device
            mx.eval(reference)
        difference = relative_error(out, reference)  # NaN where the CPU has none
        nan = bool(mx.isnan(out.astype(mx.float32)).any().item())
        if first_off is None and not difference <= args.tolerance:
            first_off = f"{name} ({type(layer).__name__}, {out.dtype}, {tuple(out.shape)})"
        if shown < args.show or np.isnan(difference):
            print(f"{name:60s} {type(layer).__name__:22s} {str(out.dtype):14s} {tuple(out.shape)} "
                  f"rel diff {difference:.2e}{'  (NaN in output)' if nan else ''}")
            shown += 1
    print(f"{len(calls)} layer calls; the first off by more than {args.tolerance:g} (or with NaN where the CPU "
          f"has none): {first_off or 'none'}")


if __name__ == "__main__":
    main()
