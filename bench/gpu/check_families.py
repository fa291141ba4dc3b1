"""Serve image and text requests together on a real-size random-weight model, on the
engine alone, and report each request's outcome (a crash shows as a missing line).

    python bench/gpu/check_families.py --arch qwen2_5_vl --preset qwen2_5_vl-7b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from fixtures.build import build_model
from vlm_serve.engine.engine import Engine
from vlm_serve.engine.scheduler import SchedulerConfig
from vlm_serve.engine.types import SamplingParams
from vlm_serve.preprocess.media import MediaPolicy
from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat


async def serve(engine, prepared):
    async def one(p):
        t, tokens, final = time.perf_counter(), 0, None
        async for event in engine.submit(p):
            tokens += len(event.token_ids)
            final = event
        return {"id": p.request_id, "tokens": tokens, "finish": final.finish_reason.value,
                "error": final.error, "seconds": round(time.perf_counter() - t, 3)}

    return await asyncio.gather(*(one(p) for p in prepared))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen2_5_vl")
    parser.add_argument("--preset", default="qwen2_5_vl-7b")
    parser.add_argument("--sizes", default="224,448,896")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = Path(f"/tmp/vlm-check-{args.preset}")
    if not (model_dir / "config.json").exists():
        build_model(args.arch, model_dir, preset=args.preset)
    engine = Engine(str(model_dir), SchedulerConfig(max_num_seqs=8))
    engine.start()
    loaded = engine.loaded
    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 4, loaded.chat_template)
    rng = np.random.default_rng(0)
    prepared = []
    for size in (int(s) for s in args.sizes.split(",")):
        image = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
        prompt = render_chat(ctx, [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Describe the picture."}]}])
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        prepared.append(prepare_prompt(ctx, f"image-{size}", prompt, params, [image]))
    text = render_chat(ctx, [{"role": "user", "content": "Tell me a story."}])
    prepared.append(prepare_prompt(ctx, "text", text, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)))
    results = asyncio.run(serve(engine, prepared))
    engine.shutdown()
    for r in results:
        print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
