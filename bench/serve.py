#!/usr/bin/env python
"""Load generator for OpenAI-compatible chat-completions servers (in the spirit of `vllm bench serve`).

It streams every request (SSE) so it can time tokens, and reports TTFT, TPOT, ITL and E2E latency
(mean, median, p90, p99, max), request and token throughput, and a "steady" output throughput that
leaves out ramp-up and drain. Prompts and images are synthetic and deterministic from --seed.

    python bench/serve.py --base-url http://127.0.0.1:8000/v1 --max-concurrency 8 \\
        --num-prompts 64 --image-size 896x896 --max-tokens 128 --result-json out.json

Only the standard library, numpy and Pillow are used. Request bodies are serialized before the clock
starts and the HTTP/SSE client is a lean one on asyncio streams (15-20 us of CPU per streamed chunk),
so 128 concurrent streams measure the server, not the client. The client's own CPU use and
event-loop lag are reported per run under "client" as a check.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import random
import ssl
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

PERCENTILES = (50, 90, 99)
STEADY_TRIM = 0.1  # the steady-throughput window opens once 10% of the tokens have arrived
MAX_ERROR_CHARS = 300
CLIENT_CPU_WARNING = 0.8  # warn when the client's process is this busy during a run
STAT_NAMES = {"mean": "Mean", "median": "Median", "p90": "P90", "p99": "P99", "max": "Max"}

# --------------------------------------------------------------------------------------------------
# Configuration and records
# --------------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    api_key: str = "EMPTY"
    timeout: float = 600.0
    # workload
    num_prompts: int = 64
    num_prompts_per_concurrency: int | None = None
    min_prompts_per_level: int = 0  # with per-concurrency counts: low levels get at least this many
    warmup: int = 2
    image_sizes: list[tuple[int, int]] = field(default_factory=lambda: [(896, 896)])
    images_per_request: int = 1
    image_format: str = "jpeg"  # jpeg | png
    image_content: str = "noise"  # noise | gradient
    prompt_tokens: int = 128
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    # load
    max_concurrency: int | None = None
    request_rate: float | None = None  # requests/s, Poisson arrivals; inf = burst; None = closed loop
    concurrency_sweep: list[int] | None = None
    # output
    label: str | None = None
    result_json: str | None = None
    save_detailed: bool = False
    quiet: bool = False


@dataclass
class RequestSpec:
    """One synthetic request, built before the timed run starts."""

    index: int
    messages: list[dict[str, Any]]
    est_prompt_tokens: int  # text only, approximate; the server's usage is preferred
    num_images: int


@dataclass
class RequestResult:
    """What one request did, in perf_counter seconds. Pure data: metrics are computed from it."""

    ok: bool
    start: float
    end: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0  # usage.completion_tokens when reported, else len(chunk_times)
    prompt_tokens: int | None = None  # usage.prompt_tokens when reported
    est_prompt_tokens: int = 0
    usage_reported: bool = False
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start


# --------------------------------------------------------------------------------------------------
# Synthetic dataset
# --------------------------------------------------------------------------------------------------

WORDS = """
the of and to in is was for on that with as by at from his her they this have had are not but
one all were when we there can an which their said if do will each about how up out them then she
many some so these would other into has more two like him see time could no make than first been
its who now people my made over did down only way find use may water long little very after words
called just where most know get through back much before go good new write our used me man too any
day same right look think also around another came come work three word must because does part even
place well such here take why help put different away again off went old number great tell men say
small every found still between name should home big give air line set own under read last never us
left end along while might next sound below saw something thought both few those always show large
often together asked house world going want school important until form food keep children feet land
side without boy once animal life enough took four head above kind began almost live page got earth
need far hand high year mother light country father let night picture being study second soon story
since white ever paper hard near sentence better best across during today however sure knew try told
young sun thing whole hear example heard several change answer room sea against top turned learn
point city play toward five himself usually money seen car morning river mountain bright window
garden quiet yellow green blue red cloud table chair market bridge train music color shadow stone
""".split()


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """'896x896' or '28x28,56x84' -> [(width, height), ...]."""
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        w, _, h = part.partition("x")
        if not (w.isdigit() and h.isdigit()) or int(w) <= 0 or int(h) <= 0:
            raise ValueError(f"bad image size {part!r}: expected WIDTHxHEIGHT, e.g. 896x896")
        sizes.append((int(w), int(h)))
    if not sizes:
        raise ValueError("no image size given")
    return sizes


def make_prompt_text(rng: random.Random, approx_tokens: int) -> tuple[str, int]:
    """Varied sentences of common words, led by a unique marker so no two prompts share a prefix.

    Common English words are about one token each; every sentence adds one for its period. Returns
    the text and its estimated token count (the server's usage.prompt_tokens is the real figure).
    """
    marker = f"Request {rng.getrandbits(64):016x}."
    tokens = 8  # the marker is roughly 8 tokens in most BPE vocabularies
    sentences = [marker]
    while tokens < approx_tokens:
        n = min(rng.randint(6, 16), max(1, approx_tokens - tokens - 1))
        words = rng.choices(WORDS, k=n)
        sentences.append(" ".join(words).capitalize() + ".")
        tokens += n + 1
    sentences.append("Describe what you see and continue the story.")
    return " ".join(sentences), tokens + 8


def make_image_array(rng: np.random.Generator, width: int, height: int, content: str) -> np.ndarray:
    """An RGB uint8 image: uniform noise, or a linear gradient between two random colours."""
    if content == "noise":
        return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    if content == "gradient":
        angle = rng.uniform(0, 2 * math.pi)
        ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
        t = xs * math.cos(angle) + ys * math.sin(angle)
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        c0, c1 = rng.uniform(0, 255, size=(2, 3)).astype(np.float32)
        return (c0 + t[..., None] * (c1 - c0)).astype(np.uint8)
    raise ValueError(f"unknown image content {content!r}")


def encode_data_url(pixels: np.ndarray, fmt: str) -> str:
    from PIL import Image

    buf = io.BytesIO()
    image = Image.fromarray(pixels, "RGB")
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt == "jpeg":
        image.save(buf, format="JPEG", quality=90)
    else:
        raise ValueError(f"unknown image format {fmt!r}")
    return f"data:image/{fmt};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def make_image_url(cfg: BenchConfig, stream: int, index: int, slot: int) -> str:
    size = cfg.image_sizes[(index * cfg.images_per_request + slot) % len(cfg.image_sizes)]
    rng = np.random.default_rng([cfg.seed, stream, index, slot])
    return encode_data_url(make_image_array(rng, size[0], size[1], cfg.image_content), cfg.image_format)


def make_request(cfg: BenchConfig, stream: int, index: int, image_urls: Sequence[str]) -> RequestSpec:
    rng = random.Random(f"{cfg.seed}:{stream}:{index}")
    text, est_tokens = make_prompt_text(rng, cfg.prompt_tokens)
    if not image_urls:
        content: Any = text
    else:
        content = [{"type": "text", "text": text}]
        content += [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    return RequestSpec(index, [{"role": "user", "content": content}], est_tokens, len(image_urls))


def build_requests(cfg: BenchConfig, stream: int, count: int) -> list[RequestSpec]:
    """`count` requests of dataset `stream` (each sweep level and the warm-up get their own stream, so
    no level can reuse another's prompt prefix). Images are encoded on a thread pool (Pillow releases
    the GIL), all before the clock starts."""
    k = cfg.images_per_request
    jobs = [(i, s) for i in range(count) for s in range(k)]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        urls = list(pool.map(lambda job: make_image_url(cfg, stream, *job), jobs))
    return [make_request(cfg, stream, i, urls[i * k : (i + 1) * k]) for i in range(count)]


# --------------------------------------------------------------------------------------------------
# Metrics (pure)
# --------------------------------------------------------------------------------------------------


def summarize(values_s: Iterable[float]) -> dict[str, float | None]:
    """Mean, median, p90, p99 and max of latencies given in seconds, reported in milliseconds."""
    arr = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {"mean": None, "median": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(arr, PERCENTILES)
    return {
        "mean": float(arr.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(arr.max()),
    }


def steady_output_throughput(results: Sequence[RequestResult], trim: float = STEADY_TRIM) -> float | None:
    """Output tokens/s while the offered load is fully on, leaving out ramp-up and drain.

    All streamed chunks of successful requests are pooled in time order, each weighted by its
    request's tokens per chunk. The window opens once `trim` of the tokens have arrived (the batch
    has filled) and closes when the last request was sent (after that the batch only drains); when
    every request was sent before the window opened (a burst), it closes once `1 - trim` of the
    tokens have arrived instead.
    """
    ok = [r for r in results if r.ok and r.chunk_times]
    times = [t for r in ok for t in r.chunk_times]
    if len(times) < 10:
        return None
    weights = [r.output_tokens / len(r.chunk_times) for r in ok for _ in r.chunk_times]
    order = np.argsort(times, kind="stable")
    t = np.asarray(times)[order]
    cum = np.cumsum(np.asarray(weights)[order])
    lo = int(np.searchsorted(cum, trim * cum[-1]))
    last_send = max(r.start for r in results)
    if last_send > t[lo]:
        hi = int(np.searchsorted(t, last_send, side="right")) - 1
    else:
        hi = int(np.searchsorted(cum, (1 - trim) * cum[-1]))
    span = t[hi] - t[lo]
    return float((cum[hi] - cum[lo]) / span) if hi > lo and span > 0 else None


def summarize_errors(results: Sequence[RequestResult]) -> dict[str, int]:
    return dict(Counter(r.error or "unknown error" for r in results if not r.ok).most_common())


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    expected_output_tokens: int | None = None) -> dict[str, Any]:
    """All run metrics from per-request records and the run's wall duration (seconds).

    TTFT: send -> first content chunk. TPOT: (E2E - TTFT) / (output_tokens - 1), per request with
    more than one token. ITL: gaps between consecutive content chunks, pooled over requests.
    E2E: send -> end of stream. Latencies in ms, throughputs per second of `duration`.
    With `expected_output_tokens` (max_tokens sent with ignore_eos), "short_outputs" counts the
    successful requests that stopped early: a server that ignores `ignore_eos`.
    """
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    reported = [r for r in ok if r.usage_reported]
    input_tokens = sum(r.est_prompt_tokens if r.prompt_tokens is None else r.prompt_tokens for r in ok)
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    decoding = [r for r in ok if r.output_tokens > 1 and r.ttft is not None and r.e2e > r.ttft]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in decoding]
    short = (None if expected_output_tokens is None
             else sum(r.output_tokens < expected_output_tokens for r in ok))

    def rate(amount: float) -> float | None:
        return amount / duration if duration > 0 else None

    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": summarize_errors(results),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "input_tokens_source": _source(len(reported), len(ok), "usage", "estimate"),
        "output_tokens_source": _source(len(reported), len(ok), "usage", "chunks"),
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "steady_output_throughput": steady_output_throughput(results),
        "mean_concurrency": rate(sum(r.e2e for r in results)),
        "mean_input_tokens": input_tokens / len(ok) if ok else None,
        "mean_output_tokens": output_tokens / len(ok) if ok else None,
        "per_request_decode_tps": float(np.mean([1 / t for t in tpots])) if tpots else None,
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in ok)),
        "short_outputs": short,
        "ttft_ms": summarize(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": summarize(tpots),
        "itl_ms": summarize(itls),
        "e2e_ms": summarize(r.e2e for r in ok),
    }


def _source(n_reported: int, n_total: int, yes: str, no: str) -> str:
    if n_total == 0 or n_reported == n_total:
        return yes
    return no if n_reported == 0 else "mixed"


# --------------------------------------------------------------------------------------------------
# Client and load generation
# --------------------------------------------------------------------------------------------------


@dataclass
class Response:
    """The status and headers of an HTTP/1.1 response, and its body as it arrives."""

    status: int
    headers: dict[str, str]
    reader: asyncio.StreamReader

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body in the pieces it arrives in: chunked, Content-Length, or until the server closes."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    return  # trailers are never used here; the connection is closed after us
                data = await self.reader.readexactly(size)
                await self.reader.readexactly(2)  # CRLF after every chunk
                yield data
        elif "content-length" in self.headers:
            yield await self.reader.readexactly(int(self.headers["content-length"]))
        else:
            while data := await self.reader.read(1 << 16):
                yield data

    async def lines(self) -> AsyncIterator[bytes]:
        buffer = b""
        async for data in self.chunks():
            buffer += data
            if b"\n" in data:
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    yield line.rstrip(b"\r")
        if buffer:
            yield buffer

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])


class Client:
    """A minimal streaming HTTP/1.1 client on asyncio streams: one connection per request.

    Why not the openai SDK or httpx: against a local SSE server at 128 concurrent streams, httpx
    costs ~85 us of client CPU per streamed chunk (the client saturates near 11k chunks/s) and the
    SDK's request building added up to ~400 ms of event-loop time to the first wave's TTFT with
    896x896 images; this reader costs 15-20 us per chunk. Bodies are serialized before the clock
    starts. A fresh connection per request (Connection: close) keeps it simple and robust: no pool,
    no stale keep-alive sockets; on loopback or a LAN the extra handshake is well under a millisecond.
    """

    def __init__(self, cfg: BenchConfig):
        url = urlsplit(cfg.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"bad --base-url {cfg.base_url!r}: expected http(s)://host[:port]/path")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.path = url.path.rstrip("/")
        self.timeout = cfg.timeout
        host_header = self.host if url.port is None else f"{self.host}:{url.port}"
        self.headers = f"Host: {host_header}\r\nUser-Agent: vlm-serve-bench\r\nConnection: close\r\n"
        if cfg.api_key:
            self.headers += f"Authorization: Bearer {cfg.api_key}\r\n"

    @asynccontextmanager
    async def request(self, method: str, path: str, body: bytes = b"") -> AsyncIterator[Response]:
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=1 << 20)
        try:
            head = (f"{method} {self.path}{path} HTTP/1.1\r\n{self.headers}"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
            head_bytes = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
            headers = {}
            for line in header_lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            yield Response(int(status_line.split()[1]), headers, reader)
        finally:
            writer.close()

    async def first_model(self) -> str:
        async def fetch() -> bytes:
            async with self.request("GET", "/models") as response:
                body = await response.read()
                if response.status != 200:
                    raise HTTPStatusError(response.status, body)
                return body

        models = json.loads(await asyncio.wait_for(fetch(), self.timeout)).get("data") or []
        if not models:
            raise RuntimeError("the server lists no models; pass --model")
        return models[0]["id"]


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {_error_message(body)}")


class StreamError(Exception):
    """An error event inside an otherwise successful (HTTP 200) stream."""


def _error_message(body: Any) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the raw text."""
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except ValueError:
            return body.decode(errors="replace").strip() if isinstance(body, bytes) else body.strip()
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or error)
        return str(body.get("detail") or error)
    return str(body)


def _format_error(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, (HTTPStatusError, StreamError)) else f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def encode_payload(cfg: BenchConfig, model: str, spec: RequestSpec) -> bytes:
    """The JSON body of one streaming chat completion, fixed-length through `ignore_eos`."""
    body: dict[str, Any] = {
        "model": model,
        "messages": spec.messages,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return json.dumps(body).encode()


async def send_request(client: Client, payload: bytes, est_prompt_tokens: int = 0) -> RequestResult:
    """Stream one chat completion and time its content chunks; give up after the client's timeout.

    Any failure (connection, HTTP status, error event, timeout, a stream without content) is
    recorded in the result, never raised.
    """
    result = RequestResult(ok=False, start=time.perf_counter(), end=0.0,
                           est_prompt_tokens=est_prompt_tokens)
    try:
        await asyncio.wait_for(_stream_chat(client, payload, result), client.timeout)
        result.ok = bool(result.chunk_times)
        if not result.ok:
            result.error = "stream ended without any content"
    except asyncio.TimeoutError:
        result.error = f"TimeoutError: no complete response within {client.timeout:g} s"
    except Exception as exc:
        result.error = _format_error(exc)
    result.end = time.perf_counter()
    return result


async def _stream_chat(client: Client, payload: bytes, result: RequestResult) -> None:
    """Per streamed chunk: a clock read, one json.loads and a few dict lookups."""
    clock = time.perf_counter
    times = result.chunk_times
    usage: dict[str, Any] | None = None
    async with client.request("POST", "/chat/completions", payload) as response:
        if response.status != 200:
            raise HTTPStatusError(response.status, await response.read())
        async for line in response.lines():
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            now = clock()
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise StreamError(f"error event: {_error_message(chunk)}")
            choices = chunk.get("choices")
            if choices:
                choice = choices[0]
                if _has_output(choice.get("delta")):
                    times.append(now)
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is not None and usage.get("completion_tokens") is not None:
        result.usage_reported = True
        result.output_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage.get("prompt_tokens")
    else:
        result.output_tokens = len(times)


def _has_output(delta: dict[str, Any] | None) -> bool:
    """Does this delta carry generated output (text, reasoning or a tool call), not just a role?"""
    return bool(delta) and bool(delta.get("content") or delta.get("tool_calls")
                                or delta.get("reasoning_content") or delta.get("reasoning"))


async def closed_loop(send, items: Sequence[Any], concurrency: int) -> list[RequestResult]:
    """`concurrency` workers, each sending its next request as soon as the previous one ends."""
    queue = iter(items)
    results: list[RequestResult] = []

    async def worker() -> None:
        for item in queue:  # a shared iterator: each item goes to exactly one worker
            results.append(await send(item))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))
    return results


async def open_loop(send, items: Sequence[Any], rate: float, concurrency: int | None,
                    rng: random.Random) -> list[RequestResult]:
    """Poisson arrivals at `rate` requests/s (inf: all at once), optionally capped at `concurrency`
    in flight: an arrival that finds the cap reached waits for a free slot."""
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    offsets, t = [], 0.0
    for _ in items:
        offsets.append(t)
        t += rng.expovariate(rate) if math.isfinite(rate) else 0.0

    async def one(item: Any, offset: float) -> RequestResult:
        delay = t0 + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            return await send(item)
        async with gate:
            return await send(item)

    return list(await asyncio.gather(*(one(item, o) for item, o in zip(items, offsets))))


class ClientMonitor:
    """Watches the client itself: how late its event loop wakes up, and how busy its CPU is.
    CPU near 100% of one core, or sustained lag, means the client, not the server, is the limit."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None
        self._cpu0 = self._wall0 = 0.0
        self.cpu_util: float | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval)
            self.lags.append(max(0.0, loop.time() - t - self.interval))

    def __enter__(self) -> ClientMonitor:
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        wall = time.perf_counter() - self._wall0
        self.cpu_util = (time.process_time() - self._cpu0) / wall if wall > 0 else None

    def summary(self) -> dict[str, float | None]:
        s = summarize(self.lags)
        return {"cpu_util": self.cpu_util, "loop_lag_ms_median": s["median"], "loop_lag_ms_p99": s["p99"],
                "loop_lag_ms_max": s["max"]}


async def run_level(client: Client, model: str, cfg: BenchConfig, specs: Sequence[RequestSpec],
                    concurrency: int | None, rate: float | None) -> dict[str, Any]:
    """One run at one load level: bodies are serialized first, then the clock starts."""
    items = [(encode_payload(cfg, model, spec), spec.est_prompt_tokens) for spec in specs]

    async def send(item: tuple[bytes, int]) -> RequestResult:
        return await send_request(client, *item)

    if rate is None and not concurrency:
        rate = math.inf  # neither a rate nor a cap: a burst, as in vllm
    with ClientMonitor() as monitor:
        start = time.perf_counter()
        if rate is None:
            results = await closed_loop(send, items, concurrency)
        else:
            rng = random.Random(f"{cfg.seed}:arrivals:{concurrency}")
            results = await open_loop(send, items, rate, concurrency, rng)
        duration = time.perf_counter() - start
    run: dict[str, Any] = {
        "max_concurrency": concurrency,
        "request_rate": _json_rate(rate),  # None: closed loop
        "num_prompts": len(specs),
        "metrics": compute_metrics(results, duration, cfg.max_tokens if cfg.ignore_eos else None),
        "client": monitor.summary(),
    }
    if cfg.save_detailed:
        run["requests"] = [_detail(r, start) for r in results]
    return run


def _json_rate(rate: float | None) -> float | str | None:
    return "inf" if rate is not None and math.isinf(rate) else rate


def _detail(r: RequestResult, t0: float) -> dict[str, Any]:
    return {"ok": r.ok, "start_s": r.start - t0, "ttft_ms": None if r.ttft is None else r.ttft * 1e3,
            "e2e_ms": r.e2e * 1e3, "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
            "chunks": len(r.chunk_times), "finish_reason": r.finish_reason, "error": r.error}


def levels(cfg: BenchConfig) -> list[int | None]:
    return list(cfg.concurrency_sweep) if cfg.concurrency_sweep else [cfg.max_concurrency]


def prompts_for(cfg: BenchConfig, concurrency: int | None) -> int:
    if cfg.num_prompts_per_concurrency and concurrency:
        return max(cfg.num_prompts_per_concurrency * concurrency, cfg.min_prompts_per_level)
    return cfg.num_prompts


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Warm up once, then run every concurrency level with fresh requests and fresh metrics."""
    plan = levels(cfg)
    client = Client(cfg)
    model = cfg.model or await client.first_model()
    log(cfg, f"model: {model}  base_url: {cfg.base_url}")
    if cfg.warmup > 0:
        await warm_up(client, model, cfg, concurrency=min(cfg.warmup, plan[0] or cfg.warmup))
    runs = []
    for i, concurrency in enumerate(plan):
        specs = build_requests(cfg, stream=i + 1, count=prompts_for(cfg, concurrency))
        rate = _json_rate(cfg.request_rate) or ("closed loop" if concurrency else "inf")
        log(cfg, f"running {len(specs)} requests, max_concurrency={concurrency}, request_rate={rate} ...")
        run = await run_level(client, model, cfg, specs, concurrency, cfg.request_rate)
        if not cfg.quiet:
            print(format_run(run, cfg.label, model), flush=True)
        runs.append(run)
    return {
        "label": cfg.label,
        "model": model,
        "base_url": cfg.base_url,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config_dict(cfg),
        "runs": runs,
    }


async def warm_up(client: Client, model: str, cfg: BenchConfig, concurrency: int) -> None:
    specs = build_requests(cfg, stream=0, count=cfg.warmup)
    payloads = [encode_payload(cfg, model, spec) for spec in specs]
    log(cfg, f"warm-up: {len(specs)} requests ...")
    results = await closed_loop(lambda payload: send_request(client, payload), payloads, concurrency)
    failed = [r for r in results if not r.ok]
    if len(failed) == len(results):
        raise RuntimeError(f"every warm-up request failed: {summarize_errors(failed)}")
    if failed:
        log(cfg, f"warm-up: {len(failed)} of {len(results)} failed: {summarize_errors(failed)}")


def config_dict(cfg: BenchConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["image_sizes"] = [f"{w}x{h}" for w, h in cfg.image_sizes]
    d["request_rate"] = _json_rate(cfg.request_rate)
    d.pop("api_key", None)
    return d


def log(cfg: BenchConfig, message: str) -> None:
    if not cfg.quiet:
        print(f"[bench] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_run(run: dict[str, Any], label: str | None, model: str) -> str:
    m = run["metrics"]
    width = 60
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(name: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{name:<42}{_fmt(value, digits):>18}")

    def section(title: str) -> None:
        lines.append(f" {title} ".center(width, "-"))

    if label:
        lines.append(f"Label: {label}")
    lines.append(f"Model: {model}")
    row("Max concurrency:", run["max_concurrency"] or "unlimited")
    row("Request rate (req/s):", run["request_rate"] or "closed loop")
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration_s"])
    row(f"Total input tokens ({m['input_tokens_source']}):", m["total_input_tokens"])
    row(f"Total output tokens ({m['output_tokens_source']}):", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Steady output throughput (tok/s):", m["steady_output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    row("Mean concurrency achieved:", m["mean_concurrency"])
    row("Per-request decode speed (tok/s):", m["per_request_decode_tps"])
    row("Finish reasons:", ", ".join(f"{k}={v}" for k, v in m["finish_reasons"].items()) or "-")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        section(title)
        short = key.split("_")[0].upper()
        for stat, name in STAT_NAMES.items():
            row(f"{name} {short} (ms):", m[key][stat])
    if m["short_outputs"]:
        lines.append(f"note: {m['short_outputs']} requests stopped before max_tokens "
                     "(does the server support ignore_eos?)")
    if m["errors"]:
        section("Errors")
        for message, count in m["errors"].items():
            lines.append(f"{count:>5} x {message}")
    cpu = run["client"]["cpu_util"]
    if cpu is not None and cpu > CLIENT_CPU_WARNING:
        lines.append(f"warning: the client used {cpu:.0%} of a CPU core; it may be the bottleneck")
    lines.append("=" * width)
    return "\n".join(lines)


def format_sweep(result: dict[str, Any]) -> str:
    """One line per level: the summary of a --concurrency-sweep."""
    head = f"{'conc':>6} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'steady':>8} " \
           f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} {'E2E p50':>9}"
    lines = [head]
    for run in result["runs"]:
        m = run["metrics"]
        lines.append(
            f"{_fmt(run['max_concurrency'] or '-'):>6} {m['completed']:>5} {m['failed']:>4} "
            f"{_fmt(m['request_throughput']):>7} {_fmt(m['output_throughput'], 1):>10} "
            f"{_fmt(m['steady_output_throughput'], 1):>8} {_fmt(m['ttft_ms']['median'], 1):>9} "
            f"{_fmt(m['ttft_ms']['p99'], 1):>9} {_fmt(m['tpot_ms']['median'], 1):>9} "
            f"{_fmt(m['itl_ms']['median'], 1):>8} {_fmt(m['e2e_ms']['median'], 0):>9}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("expected positive integers, e.g. 1,8,32")
    return values


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("request rate must be > 0 (or inf)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    s.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    s.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64, help="requests per run (per sweep level)")
    w.add_argument("--num-prompts-per-concurrency", type=int, default=None,
                   help="if set, each level sends this many requests per unit of concurrency")
    w.add_argument("--min-prompts-per-level", type=int, default=0,
                   help="with --num-prompts-per-concurrency: at least this many requests a level "
                        "(a level of 1 or 2 otherwise times only a few requests)")
    w.add_argument("--warmup", type=int, default=2, help="uncounted requests sent once, before the first run")
    w.add_argument("--image-size", default="896x896", help="WIDTHxHEIGHT, or a list used round-robin")
    w.add_argument("--images-per-request", type=int, default=1, help="0 = text only")
    w.add_argument("--image-format", choices=("jpeg", "png"), default="jpeg")
    w.add_argument("--image-content", choices=("noise", "gradient"), default="noise")
    w.add_argument("--prompt-tokens", type=int, default=128, help="approximate text length in tokens")
    w.add_argument("--max-tokens", type=int, default=128, help="output length (fixed with ignore_eos)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send the ignore_eos extension (outputs may then be shorter)")
    w.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into each request body")
    w.add_argument("--seed", type=int, default=0)
    ld = p.add_argument_group("load")
    ld.add_argument("--max-concurrency", type=int, default=None,
                    help="requests in flight; without --request-rate this is a closed loop")
    ld.add_argument("--request-rate", type=_rate, default=None,
                    help="Poisson arrivals per second (inf = all at once); default: closed loop, "
                         "or all at once when --max-concurrency is not given either")
    ld.add_argument("--concurrency-sweep", type=_int_list, default=None,
                    help="comma-separated concurrency levels, one run each (overrides --max-concurrency)")
    o = p.add_argument_group("output")
    o.add_argument("--label", default=None, help="name of this server/config in results and plots")
    o.add_argument("--result-json", default=None, help="write config and all metrics here")
    o.add_argument("--save-detailed", action="store_true", help="include per-request records in the JSON")
    o.add_argument("--quiet", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.images_per_request < 0 or args.num_prompts <= 0 or args.max_tokens <= 0:
        raise ValueError("--images-per-request must be >= 0, --num-prompts and --max-tokens > 0")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be > 0")
    if min(args.warmup, args.num_prompts_per_concurrency or 0, args.min_prompts_per_level,
           args.prompt_tokens) < 0:
        raise ValueError("--warmup, --num-prompts-per-concurrency, --min-prompts-per-level and "
                         "--prompt-tokens must be >= 0")
    return BenchConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key, timeout=args.timeout,
        num_prompts=args.num_prompts, num_prompts_per_concurrency=args.num_prompts_per_concurrency,
        min_prompts_per_level=args.min_prompts_per_level,
        warmup=args.warmup, image_sizes=parse_image_sizes(args.image_size),
        images_per_request=args.images_per_request, image_format=args.image_format,
        image_content=args.image_content, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
        temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=args.extra_body,
        seed=args.seed, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
        concurrency_sweep=args.concurrency_sweep, label=args.label, result_json=args.result_json,
        save_detailed=args.save_detailed, quiet=args.quiet,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = asyncio.run(run_benchmark(cfg))
    except KeyboardInterrupt:
        print("[bench] interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"[bench] error: {_format_error(exc)}", file=sys.stderr)
        return 1
    if len(result["runs"]) > 1 and not cfg.quiet:
        print(format_sweep(result))
    if cfg.result_json:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.result_json)), exist_ok=True)
        with open(cfg.result_json, "w") as f:
            json.dump(result, f, indent=2)
        log(cfg, f"wrote {cfg.result_json}")
    return 0 if any(run["metrics"]["completed"] for run in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
