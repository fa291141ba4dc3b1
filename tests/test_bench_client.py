"""Tests of the benchmark client, bench/serve.py (and bench/plot.py).

The metrics are checked on hand-made timing records. The end-to-end tests run the client against a
tiny fake streaming server defined here: a STAND-IN for the server under test, so these tests do
not depend on vlm_serve. It speaks just enough of the OpenAI chat-completions API (SSE chunks with
small sleeps, a usage chunk, [DONE]) and records what it was sent.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


bench = _load("bench_serve", ROOT / "bench" / "serve.py")
RequestResult = bench.RequestResult


# --------------------------------------------------------------------------------------------------
# Metrics on synthetic records
# --------------------------------------------------------------------------------------------------


def _record(start, ttft, itl, n, usage=True, prompt=100):
    """A successful request: first token at start+ttft, then a chunk every `itl` seconds."""
    times = [start + ttft + i * itl for i in range(n)]
    return RequestResult(ok=True, start=start, end=times[-1], chunk_times=times, output_tokens=n,
                         prompt_tokens=prompt if usage else None, est_prompt_tokens=50,
                         usage_reported=usage, finish_reason="length")


def test_summarize_percentiles_in_ms():
    s = bench.summarize([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["mean"] == pytest.approx(50.5)
    assert s["median"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert s["max"] == pytest.approx(100.0)
    assert bench.summarize([]) == {"mean": None, "median": None, "p90": None, "p99": None, "max": None}


def test_compute_metrics_on_synthetic_records():
    records = [
        _record(0.0, ttft=0.1, itl=0.01, n=11),  # e2e 0.2, tpot 0.01
        _record(0.0, ttft=0.2, itl=0.02, n=11),  # e2e 0.4, tpot 0.02
        _record(1.0, ttft=0.3, itl=0.03, n=11),  # e2e 0.6, tpot 0.03
        RequestResult(ok=False, start=1.0, end=1.5, error="APIStatusError 500: boom"),
        RequestResult(ok=False, start=1.0, end=1.1, error="APIStatusError 500: boom"),
    ]
    m = bench.compute_metrics(records, duration=2.0)
    assert m["completed"] == 3 and m["failed"] == 2
    assert m["errors"] == {"APIStatusError 500: boom": 2}
    assert m["total_output_tokens"] == 33 and m["total_input_tokens"] == 300
    assert m["input_tokens_source"] == "usage" and m["output_tokens_source"] == "usage"
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(16.5)
    assert m["total_token_throughput"] == pytest.approx(166.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["ttft_ms"]["median"] == pytest.approx(200.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(280.0)
    assert m["ttft_ms"]["max"] == pytest.approx(300.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(20.0)
    assert m["tpot_ms"]["p99"] == pytest.approx(29.8)
    assert m["itl_ms"]["median"] == pytest.approx(20.0)  # 10 gaps each of 10, 20, 30 ms
    assert m["itl_ms"]["mean"] == pytest.approx(20.0)
    assert m["e2e_ms"]["mean"] == pytest.approx(400.0)
    assert m["e2e_ms"]["median"] == pytest.approx(400.0)
    assert m["per_request_decode_tps"] == pytest.approx(np.mean([100, 50, 100 / 3]))
    assert m["mean_concurrency"] == pytest.approx((0.2 + 0.4 + 0.6 + 0.5 + 0.1) / 2.0)
    assert m["finish_reasons"] == {"length": 3}
    assert m["short_outputs"] is None
    assert bench.compute_metrics(records, 2.0, expected_output_tokens=11)["short_outputs"] == 0
    assert bench.compute_metrics(records, 2.0, expected_output_tokens=12)["short_outputs"] == 3


def test_token_counts_fall_back_to_chunks_and_estimates():
    records = [_record(0.0, 0.1, 0.01, 5, usage=False)]
    records[0].output_tokens = 5  # what send_request sets when no usage arrives: the chunk count
    m = bench.compute_metrics(records, duration=1.0)
    assert m["output_tokens_source"] == "chunks" and m["input_tokens_source"] == "estimate"
    assert m["total_input_tokens"] == 50
    both = bench.compute_metrics(records + [_record(0.0, 0.1, 0.01, 5)], duration=1.0)
    assert both["output_tokens_source"] == "mixed"


def test_metrics_with_nothing_completed():
    m = bench.compute_metrics([RequestResult(ok=False, start=0, end=1, error="x")], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["output_throughput"] == 0
    assert m["ttft_ms"]["median"] is None and m["steady_output_throughput"] is None


def test_steady_throughput_ignores_ramp_and_drain():
    # Closed loop: 4 streams of back-to-back 10-token requests at 10 tok/s for 10 s (40 tok/s), then
    # a last request sent at t=9 drains alone for 20 s at 10 tok/s.
    records = [_record(float(s), 0.1, 0.1, 10) for s in range(10) for _ in range(4)]
    records.append(_record(9.0, 0.1, 0.1, 200))
    steady = bench.steady_output_throughput(records)
    overall = bench.compute_metrics(records, duration=29.0)["output_throughput"]
    assert steady == pytest.approx(40.0, rel=0.05)
    assert overall == pytest.approx(600 / 29)
    # A burst (everything sent at t=0): the window is the middle 80% of the tokens.
    burst = [_record(0.0, 0.0, 0.1, 100) for _ in range(2)]
    assert bench.steady_output_throughput(burst) == pytest.approx(20.0, rel=0.05)
    # Chunks that carry two tokens each count double.
    for r in burst:
        r.output_tokens = 200
    assert bench.steady_output_throughput(burst) == pytest.approx(40.0, rel=0.05)
    assert bench.steady_output_throughput([_record(0.0, 0.1, 0.1, 5)]) is None  # too few chunks


# --------------------------------------------------------------------------------------------------
# Synthetic dataset
# --------------------------------------------------------------------------------------------------


def _cfg(**kw):
    return bench.BenchConfig(**{"image_sizes": [(28, 28), (56, 84)], "images_per_request": 2, **kw})


def test_dataset_is_deterministic_and_varied():
    a = bench.build_requests(_cfg(seed=1), stream=1, count=4)
    b = bench.build_requests(_cfg(seed=1), stream=1, count=4)
    c = bench.build_requests(_cfg(seed=2), stream=1, count=4)
    d = bench.build_requests(_cfg(seed=1), stream=2, count=4)
    assert [r.messages for r in a] == [r.messages for r in b]
    texts = [r.messages[0]["content"][0]["text"] for r in a]
    assert len({t.split(".")[0] for t in texts}) == 4  # a unique marker leads every prompt
    assert texts != [r.messages[0]["content"][0]["text"] for r in c]
    assert texts != [r.messages[0]["content"][0]["text"] for r in d]
    sizes = [_image_size(part["image_url"]["url"]) for r in a for part in r.messages[0]["content"][1:]]
    assert sizes == [(28, 28), (56, 84)] * 4  # round-robin over the list
    n_words = len(texts[0].split())
    assert 80 <= n_words <= 140 and 100 <= a[0].est_prompt_tokens <= 160  # ~128 tokens


def test_text_only_and_png_gradient():
    text_only = bench.build_requests(_cfg(images_per_request=0, prompt_tokens=20), stream=1, count=2)
    assert isinstance(text_only[0].messages[0]["content"], str) and text_only[0].num_images == 0
    cfg = _cfg(images_per_request=1, image_format="png", image_content="gradient")
    url = bench.build_requests(cfg, stream=1, count=1)[0].messages[0]["content"][1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,") and _image_size(url) == (28, 28)


def test_parse_image_sizes():
    assert bench.parse_image_sizes("896x896") == [(896, 896)]
    assert bench.parse_image_sizes("28x28, 56X84") == [(28, 28), (56, 84)]
    for bad in ("", "28", "0x10", "axb"):
        with pytest.raises(ValueError):
            bench.parse_image_sizes(bad)


def _image_size(data_url: str) -> tuple[int, int]:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).size


# --------------------------------------------------------------------------------------------------
# Fake streaming server: a stand-in for the server under test (NOT the real vlm-serve)
# --------------------------------------------------------------------------------------------------

FAKE_TOKEN_DELAY = 0.005  # seconds between streamed chunks


def _fake_app(seen: list[dict]):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-vlm", "object": "model",
                                                         "created": 0, "owned_by": "test"}]})

    async def chat(request):
        body = await request.json()
        seen.append(body)
        model = body.get("model")
        if model == "broken":
            return JSONResponse({"error": {"message": "model is broken", "type": "invalid_request_error"}},
                                status_code=400)
        n = int(body.get("max_tokens", 16))
        with_usage = bool(body.get("stream_options", {}).get("include_usage")) and model != "no-usage"

        def event(delta, finish=None, usage=None):
            choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
            chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model,
                     "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk)}\n\n"

        async def stream():
            yield event({"role": "assistant", "content": ""})
            for i in range(n):
                await asyncio.sleep(FAKE_TOKEN_DELAY)
                if model == "fails-mid-stream" and i == 2:
                    yield f"data: {json.dumps({'error': {'message': 'engine step failed'}})}\n\n"
                    return
                yield event({"content": f" tok{i}"})
            yield event({}, finish="length")
            if with_usage:
                yield event(None, usage={"prompt_tokens": 42, "completion_tokens": n, "total_tokens": 42 + n})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def fake_server():
    """Runs the fake app under hypercorn on a free loopback port in a background thread."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.loglevel = "WARNING"
    config.accesslog = None
    seen: list[dict] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(serve(_fake_app(seen), config, shutdown_trigger=stop.wait))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
    yield {"base_url": f"http://127.0.0.1:{port}/v1", "seen": seen}
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=5)


def _run_cli(fake_server, tmp_path, *args, name="result.json"):
    out = tmp_path / name
    rc = bench.main(["--base-url", fake_server["base_url"], "--result-json", str(out), "--quiet", *args])
    return rc, json.loads(out.read_text())


def test_end_to_end_against_fake_server(fake_server, tmp_path, capsys):
    fake_server["seen"].clear()
    t0 = time.monotonic()
    out = tmp_path / "e2e.json"
    rc = bench.main(["--base-url", fake_server["base_url"], "--num-prompts", "8", "--max-concurrency", "4",
                     "--max-tokens", "5", "--image-size", "32x32", "--warmup", "1", "--label", "fake",
                     "--result-json", str(out)])
    assert time.monotonic() - t0 < 10
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Median TTFT (ms)" in printed
    result = json.loads(out.read_text())
    assert result["label"] == "fake" and result["model"] == "fake-vlm"  # from GET /v1/models
    assert result["config"]["max_tokens"] == 5 and "api_key" not in result["config"]
    (run,) = result["runs"]
    m = run["metrics"]
    assert run["max_concurrency"] == 4 and run["num_prompts"] == 8
    assert m["completed"] == 8 and m["failed"] == 0 and m["errors"] == {}
    assert m["total_output_tokens"] == 40 and m["output_tokens_source"] == "usage"
    assert m["total_input_tokens"] == 8 * 42
    assert m["finish_reasons"] == {"length": 8} and m["short_outputs"] == 0
    assert 0 < m["ttft_ms"]["median"] < 1000
    assert FAKE_TOKEN_DELAY * 1000 * 0.5 < m["itl_ms"]["median"] < 200
    assert m["tpot_ms"]["mean"] > 0 and m["e2e_ms"]["p99"] >= m["e2e_ms"]["median"] >= m["ttft_ms"]["median"]
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert m["total_token_throughput"] > m["output_throughput"]
    assert 1.0 < m["mean_concurrency"] <= 4.01
    # What the server was sent: 1 warm-up + 8 requests, each streamed with the fixed-length extensions.
    seen = fake_server["seen"]
    assert len(seen) == 9
    for body in seen:
        assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
        assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0
        content = body["messages"][0]["content"]
        images = [p for p in content if p["type"] == "image_url"]
        assert len(images) == 1 and _image_size(images[0]["image_url"]["url"]) == (32, 32)
    assert len({b["messages"][0]["content"][0]["text"] for b in seen}) == 9


def test_sweep_rate_and_chunk_counting(fake_server, tmp_path):
    rc, result = _run_cli(fake_server, tmp_path, "--model", "no-usage", "--concurrency-sweep", "1,3",
                          "--num-prompts", "3", "--max-tokens", "3", "--images-per-request", "0",
                          "--warmup", "0", "--request-rate", "200", "--save-detailed", "--no-ignore-eos")
    assert rc == 0
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 3]
    for run in result["runs"]:
        m = run["metrics"]
        assert run["request_rate"] == 200
        assert m["completed"] == 3 and m["output_tokens_source"] == "chunks" and m["total_output_tokens"] == 9
        assert m["short_outputs"] is None  # --no-ignore-eos: no fixed length to check
        assert len(run["requests"]) == 3 and all(r["chunks"] == 3 for r in run["requests"])
    assert "ignore_eos" not in fake_server["seen"][-1]


def test_failures_are_counted_and_summarized(fake_server, tmp_path):
    rc, result = _run_cli(fake_server, tmp_path, "--model", "broken", "--num-prompts", "3", "--warmup", "0",
                          "--request-rate", "inf", "--max-tokens", "2", "--image-size", "8x8")
    assert rc == 1  # nothing completed
    assert result["runs"][0]["request_rate"] == "inf" and result["runs"][0]["max_concurrency"] is None
    m = result["runs"][0]["metrics"]
    assert m["completed"] == 0 and m["failed"] == 3
    ((message, count),) = m["errors"].items()
    assert count == 3 and "400" in message and "model is broken" in message


def test_plot_from_result_files(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _load("bench_plot", ROOT / "bench" / "plot.py")
    for label, scale in (("a", 1.0), ("b", 2.0)):
        runs = [{"max_concurrency": c, "metrics": {"output_throughput": 10 * c * scale,
                                                   "steady_output_throughput": 11 * c * scale,
                                                   "ttft_ms": {"median": 5.0 * c}}} for c in (1, 4, 16)]
        (tmp_path / f"{label}.json").write_text(json.dumps({"label": label, "runs": runs}))
    out = tmp_path / "plot.png"
    assert plot.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_error_events_and_timeouts_fail_requests(fake_server, tmp_path):
    rc, result = _run_cli(fake_server, tmp_path, "--model", "fails-mid-stream", "--num-prompts", "2",
                          "--warmup", "0", "--max-concurrency", "2", "--max-tokens", "5",
                          "--images-per-request", "0")
    m = result["runs"][0]["metrics"]
    assert rc == 1 and m["failed"] == 2 and m["errors"] == {"error event: engine step failed": 2}
    rc, result = _run_cli(fake_server, tmp_path, "--num-prompts", "2", "--warmup", "0", "--timeout", "0.1",
                          "--max-concurrency", "2", "--max-tokens", "100", "--images-per-request", "0")
    ((message, count),) = result["runs"][0]["metrics"]["errors"].items()
    assert rc == 1 and count == 2 and message.startswith("TimeoutError")


def test_levels_of_few_requests_per_concurrency_get_a_floor(fake_server, tmp_path):
    rc, result = _run_cli(fake_server, tmp_path, "--model", "no-usage", "--concurrency-sweep", "1,3",
                          "--num-prompts-per-concurrency", "1", "--min-prompts-per-level", "2",
                          "--max-tokens", "2", "--images-per-request", "0", "--warmup", "0")
    assert rc == 0
    assert [r["metrics"]["completed"] for r in result["runs"]] == [2, 3]
