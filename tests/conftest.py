"""Shared test fixtures: tiny models built locally, engines, a real server on loopback."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
import time

import numpy as np
import pytest
from PIL import Image

from vlm_serve.fixtures.build import cached_model
from vlm_serve.config import ServerConfig

ARCHS = ["gemma3", "qwen2_5_vl", "gemma4"]


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic RGB test image: a gradient with noise."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    base = (x * 0.6 + y * 0.4) * np.ones((1, 1, 3))
    pixels = np.clip(base + rng.normal(0, 40, (height, width, 3)), 0, 255)
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="session")
def model_path():
    """Path of the tiny model of an architecture, built once per session."""
    return lambda arch: cached_model(arch)


def engine_and_plain(arch: str, dtype: str = "float32") -> tuple:
    """(the engine's copy of ``arch``'s tiny model, with its family, and mlx-vlm's own
    copy, as it loads it), both in ``dtype``: the second is the reference for code that
    replaces parts of the model code on the first."""
    import mlx.core as mx

    from vlm_serve.engine.families import family_for
    from vlm_serve.engine.loader import load

    loaded, plain = load(str(cached_model(arch))), load(str(cached_model(arch))).model
    if dtype != "float32":
        loaded.model.set_dtype(getattr(mx, dtype))
        plain.set_dtype(getattr(mx, dtype))
    loaded.family = family_for(loaded.model)
    return loaded, plain


def prompt_inputs(loaded, images: list, text: str = "What is in these?") -> tuple:
    """(ids (1, L) int32, the model's inputs) of one user turn of ``images`` then
    ``text``, prepared as the server prepares a request for ``loaded``'s model."""
    import mlx.core as mx

    from vlm_serve.engine.model_inputs import model_arrays
    from vlm_serve.engine.types import SamplingParams
    from vlm_serve.preprocess.media import MediaPolicy
    from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat

    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 4, loaded.chat_template)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = render_chat(ctx, [{"role": "user", "content": content}])
    prepared = prepare_prompt(ctx, "prompt", prompt, SamplingParams(max_tokens=1), images)
    return mx.array(prepared.input_ids[None], mx.int32), model_arrays(prepared)


def time_behind_queued_work(call) -> tuple[float, float]:
    """(seconds ``call()`` took, seconds of device work queued just before it): a chain of
    matmuls grown until it takes the device (here the CPU) at least a second, queued
    with ``mx.async_eval``. A ``call`` that reads anything back from the device waits
    for all of it; one that does not returns while it still runs."""
    import mlx.core as mx

    def work(size: int) -> mx.array:
        x = mx.random.normal((size, size), key=mx.random.key(0))
        y = x
        for _ in range(8):
            y = (y @ x) / size
        return y

    size, took = 256, 0.0
    while took < 1.0:
        size *= 2
        start = time.perf_counter()
        mx.eval(work(size))
        took = time.perf_counter() - start
    queued = work(size)
    mx.async_eval(queued)
    start = time.perf_counter()
    call()
    spent = time.perf_counter() - start
    mx.eval(queued)
    return spent, took


def assert_embeds_without_waiting(family, ids, inputs: dict, features=None) -> None:
    """``family`` embeds a prompt as the engine does, then takes the row's state (read
    when it joins the batch) and its first prefill chunk's arguments, all while device
    work queued just before still runs: nothing of it was read back from the device,
    where each read would wait for all of that work."""
    import mlx.core as mx

    mx.eval(family.embed(ids, inputs, features=features)[0])  # first use's setup, not timed

    def embed():
        _, kwargs = family.embed(mx.array(np.asarray(ids)), inputs, features=features)
        family.row_state(kwargs, None)
        family.chunk_kwargs(kwargs, 0, ids.shape[1] // 2)

    spent, queued = time_behind_queued_work(embed)
    assert spent < queued / 4, f"embedding took {spent:.2f} s behind {queued:.2f} s of queued work"


def wait_until(condition, timeout: float = 10.0) -> None:
    """Poll ``condition()`` until it holds; fail after ``timeout`` seconds. For state the
    worker thread settles after a request's last event (a finished row leaves the batch
    once its answer is kept for the prefix cache, just after its last event goes out)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OneFault:
    """A scheduler fault hook that raises once in ``phase``; ``fired.clear()`` rearms it."""

    def __init__(self, phase: str = "decode"):
        self.phase = phase
        self.fired = threading.Event()

    def __call__(self, phase: str, states) -> None:
        if phase == self.phase and not self.fired.is_set():
            self.fired.set()
            raise RuntimeError("injected fault")


class RunningServer:
    """The real app under Hypercorn on a loopback port, in a background thread."""

    def __init__(self, config: ServerConfig):
        from vlm_serve.api.app import create_app
        from vlm_serve.server import build_engine, hypercorn_config, run_event_loop

        self.config = config
        self.engine = build_engine(config)
        self.app = create_app(self.engine, config)
        self.base_url = f"http://{config.host}:{config.port}"
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        started = threading.Event()

        async def main():
            from hypercorn.asyncio import serve

            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            started.set()
            await serve(self.app, hypercorn_config(config), shutdown_trigger=self._stop.wait)

        # The server's own event loop (uvloop where installed), as in production.
        self._thread = threading.Thread(target=run_event_loop, args=(main(),), daemon=True)
        self._thread.start()
        started.wait(10)
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        for _ in range(200):
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            threading.Event().wait(0.05)
        raise RuntimeError("server did not start")

    @property
    def scheduler(self):
        return self.engine.scheduler

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=kwargs.pop("api_key", "none"), **kwargs)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self.engine.shutdown()


@pytest.fixture(scope="module")
def start_server():
    """Factory: start a server for a model with config overrides; stopped at module end."""
    servers = []

    def start(arch: str = "gemma3", **overrides) -> RunningServer:
        # The tests' prompts are short: every prefix counts (a GPU's default skips short ones).
        overrides.setdefault("prefix_cache_min_tokens", 1)
        config = ServerConfig(
            model=str(cached_model(arch)), served_model_name=f"tiny-{arch}", port=free_port(),
            log_level="warning", **overrides,
        )
        server = RunningServer(config)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
