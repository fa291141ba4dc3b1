"""Operator-side features over real HTTP: CORS, --version, flags from VLM_SERVE_*
variables, --chat-template, image resolution bounds, vLLM-named metrics, packaging."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import data_url, make_image
from vlm_serve.cli import parse_config
from vlm_serve.config import ServerConfig
from vlm_serve.preprocess import media
from vlm_serve.preprocess.media import MediaPolicy, fit_resolution
from vlm_serve.server import StartupError, read_chat_template

ROOT = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
GOOD, BAD = "http://app.example", "http://evil.example"


def ask(server, content, **extra) -> dict:
    r = httpx.post(server.base_url + CHAT, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def image_part(image, detail=None) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image), "detail": detail}}


# -- CORS ------------------------------------------------------------------------------


def preflight(server, origin: str) -> httpx.Response:
    return httpx.options(server.base_url + CHAT, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})


def test_cors_preflight_and_responses_for_allowed_origins_only(start_server):
    server = start_server(allowed_origins=[GOOD], api_key="sekret")
    ok = preflight(server, GOOD)  # no credentials: a browser sends none on a preflight
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == GOOD
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert "x-stainless-os" in ok.headers["access-control-allow-headers"].lower()

    denied = preflight(server, BAD)
    assert "access-control-allow-origin" not in denied.headers
    # The real request: allowed origins may read even an error; others get no header.
    r = httpx.get(server.base_url + "/v1/models", headers={"Origin": GOOD})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == GOOD
    r = httpx.get(server.base_url + "/v1/models", headers={"Origin": BAD, "Authorization": "Bearer sekret"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_no_cors_headers_by_default(start_server):
    server = start_server()
    r = preflight(server, GOOD)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.base_url + "/v1/models", headers={"Origin": GOOD})
    assert "access-control-allow-origin" not in r.headers


# -- command line and environment -------------------------------------------------------


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlm_serve.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_version_prints_the_versions_and_exits_0():
    from importlib.metadata import version

    out = run_cli("--version")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"vlm-serve {version('vlm-serve')} ")
    assert f"mlx {version('mlx')}" in line and f"mlx-vlm {version('mlx-vlm')}" in line


@pytest.mark.parametrize("name", ["MLX_ENABLE_CACHE_THRASHING_CHECK", "MLX_USE_CUDA_GRAPHS"])
@pytest.mark.parametrize("preset,expected", [(None, "0"), ("1", "1")])
def test_importing_vlm_serve_sets_mlx_serving_defaults_unless_set(name, preset, expected):
    """MLX's CUDA caches raise on every miss once a long-running process has missed more
    than twice their capacity, and CUDA graphs cost more than they save when prompt
    shapes keep changing: vlm-serve turns both off before MLX reads them, and keeps an
    operator's own value."""
    env = {k: v for k, v in os.environ.items() if k != name}
    if preset is not None:
        env[name] = preset
    out = subprocess.run(
        [sys.executable, "-c", f"import vlm_serve, os; print(os.environ['{name}'])"],
        env=env, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == expected


def test_every_flag_from_the_environment_and_the_command_line_wins():
    env = {"VLM_SERVE_API_KEY": "from-env", "VLM_SERVE_MAX_NUM_SEQS": "64",
           "VLM_SERVE_WARMUP": "0", "VLM_SERVE_NO_ACCESS_LOG": "true",
           "VLM_SERVE_ALLOWED_ORIGINS": "http://a.example, http://b.example",
           "VLM_SERVE_MEDIA_FETCH_TIMEOUT": "2.5", "VLM_SERVE_LOG_LEVEL": "debug",
           "VLM_SERVE_FIXTURE_CACHE": "/not/a/flag"}
    config = parse_config([], env)
    assert (config.api_key, config.max_num_seqs, config.warmup, config.access_log) == ("from-env", 64, False, False)
    assert config.allowed_origins == ["http://a.example", "http://b.example"]
    assert (config.media_fetch_timeout_s, config.log_level) == (2.5, "debug")

    config = parse_config(["--max-num-seqs", "3", "--warmup", "--allowed-origins", "http://c.example"], env)
    assert (config.max_num_seqs, config.warmup, config.allowed_origins) == (3, True, ["http://c.example"])
    assert parse_config([], {}) == ServerConfig()


@pytest.mark.parametrize("name,value,expected", [
    ("VLM_SERVE_MAX_NUM_SEQS", "lots", "not a valid int"),
    ("VLM_SERVE_WARMUP", "maybe", "expected 1/0/true/false"),
    ("VLM_SERVE_TOOL_CALL_PARSER", "nope", "expected one of"),
    ("VLM_SERVE_PREFILL_WAIT_STEPS", "-1", "0 or more"),
])
def test_a_bad_environment_value_is_one_line_naming_the_variable(name, value, expected):
    out = run_cli(env={name: value})
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and expected in lines[0], out.stderr


# -- --chat-template -------------------------------------------------------------------

# Gemma-shaped, with a system preamble of its own: its prompts are longer, and its
# content-shape (list parts only) must be detected from it, not from the checkpoint's.
OVERRIDE = (
    "{{ bos_token }}<start_of_turn>user\nYou are a pirate. Answer like a pirate, always.\n"
    "{% for m in messages %}{% if m.role != 'user' %}<start_of_turn>{{ m.role }}\n{% endif %}"
    "{% for part in m.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
)


def test_chat_template_file_replaces_the_checkpoints(start_server, tmp_path):
    path = tmp_path / "pirate.jinja"
    path.write_text(OVERRIDE)
    plain, pirate = start_server(), start_server(chat_template=str(path))
    assert pirate.app.state.vlm.prompt_context.chat_template == OVERRIDE
    assert pirate.app.state.vlm.prompt_context.chat_format.list_roles >= {"user"}
    base = ask(plain, "hello there")["usage"]["prompt_tokens"]
    assert ask(pirate, "hello there")["usage"]["prompt_tokens"] > base + 5


def test_chat_template_json_file_and_bad_paths(tmp_path):
    (tmp_path / "t.json").write_text('{"chat_template": "{{ messages }}"}')
    assert read_chat_template(ServerConfig(chat_template=str(tmp_path / "t.json"))) == "{{ messages }}"
    with pytest.raises(StartupError, match="--chat-template .*missing"):
        read_chat_template(ServerConfig(chat_template=str(tmp_path / "missing.jinja")))
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(StartupError, match="no template"):
        read_chat_template(ServerConfig(chat_template=str(tmp_path / "empty.jinja")))


# -- image resolution bounds -----------------------------------------------------------
# The tiny qwen2_5_vl processor turns each 28x28 area into one image token (56x56: 4,
# 112x112: 16, its cap), so the size the processor sees shows in prompt_tokens.


def test_fit_resolution_keeps_the_aspect_ratio():
    wide = make_image(200, 100)
    assert fit_resolution(wide, MediaPolicy()).size == (200, 100)
    assert fit_resolution(wide, MediaPolicy(), "high").size == (200, 100)
    assert fit_resolution(make_image(2048, 1024), MediaPolicy(), "low").size == (512, 256)
    assert fit_resolution(make_image(300, 200), MediaPolicy(), "low").size == (300, 200)
    grown = fit_resolution(wide, MediaPolicy(min_image_pixels=80_000))
    assert grown.size == (400, 200)


def test_detail_low_shrinks_the_image_before_the_processor(start_server, monkeypatch):
    server = start_server("qwen2_5_vl")
    image = make_image(112, 112)
    tokens = {d: ask(server, [image_part(image, d), {"type": "text", "text": "what?"}])["usage"]["prompt_tokens"]
              for d in (None, "auto", "high")}
    assert len(set(tokens.values())) == 1
    # OpenAI's low detail is 512x512, above this tiny processor's cap: shrink the bound.
    monkeypatch.setattr(media, "LOW_DETAIL_SIZE", 56)
    low = ask(server, [image_part(image, "low"), {"type": "text", "text": "what?"}])["usage"]["prompt_tokens"]
    assert low == tokens["high"] - (16 - 4)


def test_min_image_pixels_upscales_small_images(start_server):
    plain, floor = start_server("qwen2_5_vl"), start_server("qwen2_5_vl", min_image_pixels=112 * 112)
    content = [image_part(make_image(56, 56)), {"type": "text", "text": "what?"}]
    assert ask(floor, content)["usage"]["prompt_tokens"] == ask(plain, content)["usage"]["prompt_tokens"] + 12


def test_bad_detail_is_a_400_naming_the_field(start_server):
    server = start_server()
    r = httpx.post(server.base_url + CHAT, json={"messages": [{"role": "user", "content": [
        image_part(make_image(28, 28), "medium")]}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url.detail"


# -- metrics ---------------------------------------------------------------------------


def test_metrics_under_vllm_names_with_model_name_and_no_created(start_server):
    server = start_server("qwen2_5_vl")
    long_text = "tell me a long story about ships and the sea " * 8
    image = make_image(56, 56)
    for _ in range(2):  # the second reuses the first's prefix KV and vision features
        ask(server, long_text)
        ask(server, [image_part(image), {"type": "text", "text": "what?"}])
    text = httpx.get(server.base_url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_success", "vllm:prefix_cache_hits", "vlm_vision_cache_hits",
                 "vlm_requests", "vlm_kv_cache_bytes", "vlm_slow_turns"):
        assert name in families, name
        assert all(s.labels.get("model_name") == "tiny-qwen2_5_vl" for s in families[name].samples), name
    assert not [line for line in text.splitlines() if "_created" in line]

    def value(name: str, **labels) -> float:
        return sum(s.value for s in families[name].samples
                   if s.name.endswith("_total") and labels.items() <= s.labels.items())

    assert value("vllm:request_success", finished_reason="length") == 4
    assert value("vllm:prefix_cache_hits") > 0
    assert value("vlm_vision_cache_hits") >= 1


# -- packaging -------------------------------------------------------------------------


def test_every_package_is_installed_and_fixtures_only_inside_vlm_serve():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "vlm_serve").rglob("__init__.py")}
    assert set(config["packages"]) == found | {"vlm_serve.fixtures"}
    assert config["package-dir"] == {"vlm_serve.fixtures": "fixtures"}
    assert not any(p == "fixtures" or p.startswith("fixtures.") for p in config["packages"])
