"""Where a chat request's time goes before the engine, per stage, for a first and a
repeated image (turn 1 and turn 2 of a multi-turn image chat, the whole conversation
and its base64 image resent).

Runs the server's own preprocessing functions in the order the chat route calls them
(JSON decode, validation, image loading, template, processor, digests), each stage
timed by a wrapper, on a Gemma 3 model with the real Gemma 3 processor settings (896 px
images, 256 image tokens) and tiny random weights, built on first use (no download):

    python bench/preprocess_profile.py [--image-size 896] [--repeats 5]

No model is run: what the engine does with the prepared request is not measured here.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from multiturn import image_url  # noqa: E402  (the same images bench/multiturn.py sends)

from vlm_serve.api import schemas  # noqa: E402
from vlm_serve.api.state import AppState  # noqa: E402
from vlm_serve.config import ServerConfig  # noqa: E402
from vlm_serve.engine.types import SamplingParams  # noqa: E402
from vlm_serve.preprocess import media, prompt  # noqa: E402

MODEL_DIR = Path("/tmp/vlm-bench-gemma3-tiny-896")


def build_model(out: Path) -> Path:
    """Tiny Gemma 3 weights behind the real Gemma-3-4B processor settings (896 px,
    256 image tokens), so preprocessing costs what it costs for the real model."""
    if (out / "config.json").exists():
        return out
    try:
        from vlm_serve.fixtures import base, build, gemma3
    except ImportError:  # not installed, only on PYTHONPATH (the GPU machines)
        from fixtures import base, build, gemma3

    dims = dict(gemma3.PRESETS["tiny"].dims, image_size=896, mm_tokens=256, v_layers=1)
    gemma3.PRESETS.setdefault("tiny-896", base.Preset(dtype="float32", dims=dims))
    return build.build_model("gemma3", out, preset="tiny-896")


class Stages:
    """Seconds per stage of the current request; wrapped functions add to it."""

    def __init__(self):
        self.now: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.now[label or name] += time.perf_counter() - start

        setattr(owner, name, timed)

    def run(self, label: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.now[label] += time.perf_counter() - start


def instrument(stages: Stages, processor) -> None:
    # Leaf stages (module globals looked up at call time, so the wrappers are seen).
    for owner, name, label in [
        (media, "read_image_bytes", "image bytes (base64 decode)"),
        (media, "decode_image", "image decode (PNG -> RGB)"),
        (media, "fit_resolution", "fit resolution"),
        (prompt, "render_chat", "chat template"),
        (prompt, "cache_digest", "image digest"),
        (prompt, "image_digest", "image digest"),  # its name before the image cache
    ]:
        stages.wrap(owner, name, label)
    # Inside the processor call: the image processor, the tokenizer, MLX round trip.
    stages.wrap(processor.image_processor, "preprocess", "image processor")
    stages.wrap(type(processor.tokenizer), "__call__", "tokenizer")
    module = sys.modules[type(processor).__module__]
    stages.wrap(module, "to_mlx", "processor to_mlx")


def request_body(image: str, turn: int) -> bytes:
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": "Describe this picture in detail."}]}]
    for t in range(1, turn):
        messages += [{"role": "assistant", "content": "A picture of noise, " * 8},
                     {"role": "user", "content": f"Tell me more, part {t + 1}."}]
    body = {"messages": messages, "max_tokens": 32, "temperature": 0, "stream": True}
    return json.dumps(body).encode()


def prepare(state, stages: Stages, raw: bytes):
    """The chat route's preprocessing (vlm_serve/api/chat.py), run on this thread."""
    loaded = state.loaded
    body = stages.run("JSON decode", schemas.decode_json, raw)
    chat = stages.run("validate", schemas.parse_chat_request, body, loaded.vocab_size, loaded.sampling_defaults)
    ctx = state.prompt_context
    refs = prompt.chat_images(ctx, chat.messages)
    images = stages.run("load images (total)", lambda: [prompt.load_chat_image(ctx, r, None) for r in refs])
    return stages.run(
        "prepare chat (total)", prompt.prepare_chat, ctx, "r", chat.messages, SamplingParams(),
        chat.active_tools, chat.chat_template_kwargs, images,
    )


def load(path: Path):
    """The model as the server loads it (its processor class depends on mlx-vlm's loading
    path: mlx-vlm's own Gemma3Processor, not transformers')."""
    from vlm_serve.engine.loader import load as load_model

    return load_model(str(path))


class State(AppState):
    """AppState's prompt context and pools, without an engine."""

    def __init__(self, loaded, config: ServerConfig):
        engine = type("NoEngine", (), {"loaded": loaded, "scheduler": None})()
        super().__init__(engine, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--turn", type=int, default=2, help="the repeated request's turn")
    parser.add_argument("--model", type=Path, default=None, help="default: a tiny Gemma 3 at 896 px")
    parser.add_argument("--result-json")
    args = parser.parse_args()

    path = args.model or build_model(MODEL_DIR)
    loaded = load(path)
    state = State(loaded, ServerConfig(model=str(path)))
    stages = Stages()
    instrument(stages, loaded.processor)

    runs: dict[str, list[dict]] = {"cold": [], "repeat": []}
    sizes = {}
    for seed in range(args.repeats + 1):  # the first round warms imports and caches up
        image = image_url(args.image_size, 1000 + seed)
        for kind, turn in (("cold", 1), ("repeat", args.turn)):
            raw = request_body(image, turn)
            sizes[kind] = len(raw)
            stages.now = defaultdict(float)
            start = time.perf_counter()
            prepared = prepare(state, stages, raw)
            stages.now["TOTAL"] = time.perf_counter() - start
            if seed:
                runs[kind].append(dict(stages.now))
    tokens = prepared.num_prompt_tokens

    labels = list(dict.fromkeys(k for kind in runs.values() for run in kind for k in run))
    labels.remove("TOTAL")
    labels.append("TOTAL")
    median = {kind: {k: 1000 * statistics.median(r.get(k, 0.0) for r in rs) for k in labels}
              for kind, rs in runs.items()}
    print(f"{args.image_size} px PNG, body {sizes['cold'] / 1e6:.2f} MB (turn 1) / "
          f"{sizes['repeat'] / 1e6:.2f} MB (turn {args.turn}, {tokens} prompt tokens); "
          f"median of {args.repeats}, ms")
    print(f"| stage | turn 1, new image | turn {args.turn}, same image |")
    print("|---|---|---|")
    for k in labels:
        print(f"| {k} | {median['cold'][k]:.1f} | {median['repeat'][k]:.1f} |")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({"config": {**vars(args), "model": str(path)},
                                                      "ms_median": median}, indent=1, default=str))


if __name__ == "__main__":
    main()
