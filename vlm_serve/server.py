"""Starting the engine and serving the app under Hypercorn."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import signal
from pathlib import Path

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from .api.app import create_app
from .config import ServerConfig
from .engine.engine import Engine
from .engine.scheduler import SchedulerConfig

log = logging.getLogger("vlm_serve")

DEMO_MODEL_ARCH = "gemma3"
HF_REPO_ID = re.compile(r"[\w][\w.-]*/[\w][\w.-]*")  # org/name
SHUTDOWN_ERROR = "the server is shutting down"


class StartupError(Exception):
    """A problem found before serving, told in one line (no traceback)."""


def check_model_arg(model: str | None) -> None:
    """Fail before anything loads when ``--model`` is neither a path nor a repo id."""
    if model is None or os.path.exists(os.path.expanduser(model)) or HF_REPO_ID.fullmatch(model):
        return
    raise StartupError(f"--model {model}: no such file or directory, and not a Hugging Face "
                       "repo id (org/name)")


def resolve_model(config: ServerConfig) -> str:
    """The model to load: ``--model``, or the built-in demo model built on first use."""
    if config.model:
        return config.model
    from vlm_serve.fixtures.build import cached_model

    path = cached_model(DEMO_MODEL_ARCH)
    log.info("no --model given: serving the built-in tiny demo model at %s", path)
    return str(path)


def on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() != mx.cpu


def default_prefill_budget() -> int:
    """Prompt tokens prefilled per scheduler turn. Measured on the demo model (CPU,
    c=16): 512 gives both more throughput and lower TTFT than 2048. On an H200 with a
    4B model, a burst of 64 image requests took 4.35-4.44 s at 4096 against 4.79-5.40 s
    at 2048 (bench/results/gpu-h200-cube-gelu-and-budget): fewer turns, so fewer decode
    steps queued behind prefill work. A pass that several prompts share may fill it."""
    return 4096 if on_gpu() else 512


def default_prefill_step() -> int:
    """A prompt's tokens per prefill pass: 2048 on a GPU (as mlx-vlm's own generate;
    half a turn's budget), 512 on the CPU. On a GPU a pass costs the host about the
    same whatever its length (each of its ~3,000 operations is launched one by one), so
    fewer, longer passes start requests sooner; on the CPU the budget already keeps a
    turn short."""
    return 2048 if on_gpu() else 512


def default_prefill_wait() -> int:
    """Decode steps a new prompt may wait, while others decode, for more prompts to share
    its prefill passes: 8 on a GPU, where a pass costs the host about as much for one
    prompt as for seven; none on the CPU, where a pass costs its arithmetic."""
    return 8 if on_gpu() else 0


def default_prefix_min_tokens() -> int:
    """The fewest tokens of a cached prefix worth reusing: 64 on a GPU, where a lookup
    copies the cache (~3 ms of the worker a request in a burst on an H200, for a chat
    template's 4-token opening) while a pass costs the host about the same whatever its
    length; any on the CPU, where a pass costs its arithmetic."""
    return 64 if on_gpu() else 1


def read_chat_template(config: ServerConfig) -> str | None:
    """The text of ``--chat-template``, read before the model loads so a bad path fails
    in one line."""
    if not config.chat_template:
        return None
    from .engine.loader import read_chat_template as read

    try:
        template = read(Path(config.chat_template).expanduser())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StartupError(f"--chat-template {config.chat_template}: {getattr(exc, 'strerror', None) or exc}") from None
    if not template or not template.strip():
        raise StartupError(f"--chat-template {config.chat_template}: no template in the file")
    return template


def build_engine(config: ServerConfig, parallel=None) -> Engine:
    """``parallel``: this process's rank of a tensor-parallel group (vlm_serve.distributed)."""
    chat_template = read_chat_template(config)
    engine = Engine(
        resolve_model(config),
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            prefill_step_size=config.prefill_step_size or default_prefill_step(),
            prefill_token_budget=config.prefill_token_budget or default_prefill_budget(),
            prefill_wait_steps=(default_prefill_wait() if config.prefill_wait_steps is None
                                else config.prefill_wait_steps),
            bucket_last_passes=on_gpu(),
            prefix_cache_entries=config.prefix_cache_size,
            prefix_cache_bytes=int(config.prefix_cache_gb * (1 << 30)),
            prefix_min_reuse=(default_prefix_min_tokens() if config.prefix_cache_min_tokens is None
                              else config.prefix_cache_min_tokens),
            kv_cache_memory=config.kv_cache_memory,
        ),
        max_queue=config.max_queue_size,
        vision_cache_size=config.vision_cache_size,
        vision_cache_bytes=int(config.vision_cache_gb * (1 << 30)),
        warm=config.warmup if config.warmup is not None else on_gpu(),
        chat_template=chat_template,
        parallel=parallel,
    )
    if parallel is not None and parallel.leader:
        parallel.on_failure = engine.fail_now  # a failed group ends every request at once
    try:
        engine.start()
    except RuntimeError as exc:
        cause = exc.__cause__ or exc
        first_line = (str(cause).strip().splitlines() or [""])[0]
        raise StartupError(f"{exc}: {type(cause).__name__}: {first_line}") from None
    return engine


def hypercorn_config(config: ServerConfig) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.accesslog = None
    hc.errorlog = "-"
    hc.loglevel = config.log_level.upper()
    # Long generations stream for a long time; don't cut idle keep-alive too early.
    hc.keep_alive_timeout = 75
    # Hypercorn cancels connections still open this long after shutdown starts. We end
    # every request ourselves at shutdown_timeout_s; the margin lets those last
    # answers reach their clients.
    hc.graceful_timeout = config.shutdown_timeout_s + 5
    return hc


def bind_now(hc: HypercornConfig, config: ServerConfig) -> None:
    """Bind the port before the model loads, so a busy port fails in a second, not
    after the load; Hypercorn takes the bound sockets over by file descriptor."""
    try:
        sockets = hc.create_sockets()
    except OSError as exc:
        raise StartupError(f"cannot bind {config.host}:{config.port}: {exc.strerror or exc}") from None
    hc.bind = [f"fd://{sock.detach()}" for sock in sockets.insecure_sockets]


def run(config: ServerConfig, parallel=None) -> None:
    """Serve until SIGTERM/SIGINT, then stop gracefully: refuse new requests (the
    listener closes; a request on an open connection gets 503), give those in flight
    ``shutdown_timeout_s`` to finish, end the rest with an error, stop the engine.
    A second signal ends the requests in flight at once."""
    check_model_arg(config.model)
    hc = hypercorn_config(config)
    bind_now(hc, config)
    engine = build_engine(config, parallel)
    app = create_app(engine, config)
    freeze_startup_objects()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                engine.abort(SHUTDOWN_ERROR)
                return
            log.info("%s: refusing new requests; %d in flight get up to %gs to finish",
                     sig.name, engine.in_flight, config.shutdown_timeout_s)
            engine.draining = True
            stop.set()

        async def abort_when_grace_ends() -> None:
            await stop.wait()
            await asyncio.sleep(config.shutdown_timeout_s)
            if engine.in_flight:
                log.warning("ending %d requests still in flight", engine.in_flight)
            engine.abort(SHUTDOWN_ERROR)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        log.info("serving %s on http://%s:%d", config.model_id, config.host, config.port)
        # The engine keeps running while Hypercorn drains; serve() returns once every
        # connection has closed.
        grace = asyncio.create_task(abort_when_grace_ends())
        try:
            await serve(app, hc, shutdown_trigger=stop.wait)
        finally:
            grace.cancel()

    try:
        run_event_loop(main())
    finally:
        engine.shutdown()
    log.info("stopped")


def freeze_startup_objects() -> None:
    """Put what loading and warm-up left alive (the model's modules, the tokenizer's
    tables, templates, the app: ~100k objects for the demo model) out of the cyclic
    garbage collector's reach, for the life of the process. Each full collection would
    otherwise walk them all under the interpreter lock, stalling the MLX worker's decode
    steps (50-91 ms each on a 2-core CPU, against 3 ms frozen:
    ``bench/results/cpu-gc-pauses``). Only for a serving process: frozen objects are
    never collected, so an engine built and dropped in-process (tests) must not."""
    gc.collect()
    gc.freeze()


def run_event_loop(main) -> None:
    """Run the server's coroutine on uvloop where it is installed (it spends less CPU
    per streamed token than asyncio's own loop, time the MLX worker thread shares the
    interpreter with), else on asyncio's (or with ``VLM_SERVE_EVENT_LOOP=asyncio``)."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is None or os.environ.get("VLM_SERVE_EVENT_LOOP") == "asyncio":
        asyncio.run(main)
    else:
        uvloop.run(main)
