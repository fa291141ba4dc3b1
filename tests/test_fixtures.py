"""The tiny random-weight fixture models: they build deterministically, load
through mlx-vlm, tokenize and template like their families, and generate."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

mx = pytest.importorskip("mlx.core")
mlx_vlm = pytest.importorskip("mlx_vlm")

from vlm_serve.fixtures import build  # noqa: E402
from vlm_serve.fixtures.build import FAMILIES, build_model, cached_model  # noqa: E402

ARCHS = ["gemma3", "qwen2_5_vl", "gemma4"]

# mlx-vlm's Gemma 4 processor always builds an audio feature extractor, whose
# mel filter bank construction warns; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter:UserWarning")

# Per family: the image placeholder token, image tokens per (width, height),
# the end-of-turn token, and its tool-call markers.
EXPECT = {
    "gemma3": {
        "image_token": "<image_soft_token>",
        "tokens_per_size": {(28, 28): 4, (56, 56): 4, (84, 56): 4},
        "turn_end": "<end_of_turn>",
        "markers": ["<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                    "<start_function_call>", "<end_function_call>", "<escape>"],
    },
    "qwen2_5_vl": {
        "image_token": "<|image_pad|>",
        "tokens_per_size": {(56, 56): 4, (84, 56): 6, (112, 112): 16, (200, 100): 10},
        "turn_end": "<|im_end|>",
        "markers": ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                    "<tool_call>", "</tool_call>"],
    },
    "gemma4": {
        "image_token": "<|image|>",
        "tokens_per_size": {(56, 56): 64, (84, 56): 60, (200, 100): 55},
        "turn_end": "<turn|>",
        "markers": ["<|turn>", "<turn|>", "<|image|>", "<|tool_call>", "<tool_call|>",
                    '<|"|>', "<|tool>", "<tool|>", "<|tool_response>", "<tool_response|>",
                    "<|channel>", "<channel|>"],
    },
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"},
                           "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}]


def gradient(width: int, height: int) -> Image.Image:
    x = np.zeros((height, width, 3), np.uint8)
    x[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    x[..., 1] = np.linspace(0, 255, height, dtype=np.uint8)[:, None]
    x[..., 2] = 128
    return Image.fromarray(x)


def render(processor, messages, **kwargs) -> str:
    # mlx-vlm's Gemma3Processor.from_pretrained gives the template to the
    # tokenizer only; mlx-vlm itself falls back to the tokenizer the same way.
    owner = processor if getattr(processor, "chat_template", None) else processor.tokenizer
    return owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                     **kwargs)


def image_messages(n_images: int = 1):
    parts = [{"type": "image"} for _ in range(n_images)]
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": parts + [{"type": "text", "text": "What is in this image?"}]},
    ]


def greedy(model, processor, prompt, image=None, max_tokens=8) -> list[int]:
    for r in mlx_vlm.stream_generate(model, processor, prompt, image=image,
                                     max_tokens=max_tokens, temperature=0.0):
        pass
    # The last result carries every generated id (and an eos id if it stopped).
    assert r.finish_reason == "length"
    return r.token_ids


@pytest.fixture(scope="session")
def fixture_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("fixture-cache")
    old = os.environ.get("VLM_SERVE_FIXTURE_CACHE")
    os.environ["VLM_SERVE_FIXTURE_CACHE"] = str(path)
    yield path
    if old is None:
        del os.environ["VLM_SERVE_FIXTURE_CACHE"]
    else:
        os.environ["VLM_SERVE_FIXTURE_CACHE"] = old


@pytest.fixture(scope="session", params=ARCHS)
def loaded(request, fixture_cache):
    arch = request.param
    path = cached_model(arch)
    model, processor = mlx_vlm.load(str(path))
    return arch, path, model, processor


def test_loads_with_expected_types(loaded):
    arch, path, model, processor = loaded
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    assert model.config.model_type == arch
    assert type(model).__module__ == f"mlx_vlm.models.{arch}.{arch}"
    # The embedding has a row per token, and the turn end stops generation.
    tokenizer = processor.tokenizer
    embed = model.language_model.model.embed_tokens.weight
    assert embed.shape[0] == len(tokenizer)
    turn_end = tokenizer.convert_tokens_to_ids(EXPECT[arch]["turn_end"])
    generation = json.loads((path / "generation_config.json").read_text())
    assert turn_end in generation["eos_token_id"]
    assert turn_end in model.config.eos_token_id or turn_end == model.config.eos_token_id


def test_saved_weights_round_trip(loaded):
    from mlx.utils import tree_flatten

    arch, path, model, _ = loaded
    saved = mx.load(str(path / "model.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    assert set(saved) <= set(params)
    assert set(params) - set(saved) == FAMILIES[arch].TIED
    for name, value in saved.items():
        assert value.dtype == mx.float32
        assert mx.array_equal(params[name], value).item(), name


def test_image_tokens_per_image_size(loaded):
    arch, _, model, processor = loaded
    image_token_id = processor.tokenizer.convert_tokens_to_ids(EXPECT[arch]["image_token"])
    prompt = render(processor, image_messages())
    for (width, height), expected in EXPECT[arch]["tokens_per_size"].items():
        inputs = processor(text=[prompt], images=[gradient(width, height)],
                           add_special_tokens=False, padding=True)
        ids = np.array(inputs["input_ids"]).ravel()
        assert int((ids == image_token_id).sum()) == expected, (width, height)


def test_two_images_in_one_prompt(loaded):
    arch, _, model, processor = loaded
    image_token_id = processor.tokenizer.convert_tokens_to_ids(EXPECT[arch]["image_token"])
    sizes = list(EXPECT[arch]["tokens_per_size"].items())[:2]
    prompt = render(processor, image_messages(2))
    inputs = processor(text=[prompt], images=[gradient(w, h) for (w, h), _ in sizes],
                       add_special_tokens=False, padding=True)
    ids = np.array(inputs["input_ids"]).ravel()
    assert int((ids == image_token_id).sum()) == sum(n for _, n in sizes)


def test_generates_varied_tokens(loaded):
    arch, _, model, processor = loaded
    (width, height) = list(EXPECT[arch]["tokens_per_size"])[-1]
    with_image = greedy(model, processor, render(processor, image_messages()),
                        image=[gradient(width, height)])
    text_only = greedy(model, processor, render(processor, [
        {"role": "user", "content": "Tell me a story about a dragon who lived in a cave."}]))
    for tokens in (with_image, text_only):
        assert len(tokens) == 8
        assert len(set(tokens)) >= 2
    assert with_image != text_only


def test_same_seed_same_bytes(tmp_path):
    for arch in ARCHS:
        a = build_model(arch, tmp_path / f"{arch}-a", seed=3)
        b = build_model(arch, tmp_path / f"{arch}-b", seed=3)
        c = build_model(arch, tmp_path / f"{arch}-c", seed=4)
        for name in sorted(p.name for p in a.iterdir()):
            assert (a / name).read_bytes() == (b / name).read_bytes(), (arch, name)
        weights = (a / "model.safetensors").read_bytes()
        assert weights != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_unicode_and_keeps_specials_whole(arch, fixture_cache):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cached_model(arch)))
    for text in ["héllo 世界 🙂", "tabs\tand\nnewlines  ", "Ω≈ç√∫ ☃ 𝄞 \u200b"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    for marker in EXPECT[arch]["markers"]:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        assert len(ids) == 1, marker
        assert tokenizer.decode(ids) == marker


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_files_agree(arch, fixture_cache):
    path = cached_model(arch)
    jinja = (path / "chat_template.jinja").read_text()
    assert json.loads((path / "chat_template.json").read_text())["chat_template"] == jinja


def test_processor_and_tokenizer_render_alike(loaded):
    arch, _, _, processor = loaded
    messages = image_messages()
    by_tokenizer = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert by_tokenizer == render(processor, messages)
    assert by_tokenizer.count(EXPECT[arch]["image_token"] if arch != "gemma3"
                              else "<start_of_image>") == 1


def test_gemma3_template_matches_the_real_layout(fixture_cache):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cached_model("gemma3")))
    text = tokenizer.apply_chat_template(image_messages() + [
        {"role": "assistant", "content": "A gradient."},
        {"role": "user", "content": "  Thanks  "},
    ], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<bos><start_of_turn>user\nYou are a helpful assistant.\n\n"
        "<start_of_image>What is in this image?<end_of_turn>\n"
        "<start_of_turn>model\nA gradient.<end_of_turn>\n"
        "<start_of_turn>user\nThanks<end_of_turn>\n<start_of_turn>model\n"
    )


def tool_conversation():
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]


Q = '<|"|>'  # Gemma 4's string quote token

TOOL_RENDERINGS = {
    "gemma3": ['get_weather(city="Paris", days=3)', "```tool_output\nsunny\n```"],
    "qwen2_5_vl": [
        "<tools>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
        "\n</tool_call>",
        "<tool_response>\nsunny\n</tool_response>",
    ],
    "gemma4": [
        f"<|tool>declaration:get_weather{{description:{Q}Get the weather{Q},parameters:"
        f"{{properties:{{city:{{description:{Q}City name{Q},type:{Q}STRING{Q}}},"
        f"days:{{type:{Q}INTEGER{Q}}}}},required:[{Q}city{Q}],type:{Q}OBJECT{Q}}}}}<tool|>",
        f"<|turn>model\n<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>"
        f"<|tool_response>response:get_weather{{value:{Q}sunny{Q}}}<tool_response|>"
        "It is sunny.<turn|>\n",
    ],
}


@pytest.mark.parametrize("arch, expected", TOOL_RENDERINGS.items())
def test_tools_render(arch, expected, fixture_cache):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cached_model(arch)))
    text = tokenizer.apply_chat_template(tool_conversation(), tools=TOOLS,
                                         add_generation_prompt=True, tokenize=False)
    for piece in expected:
        assert piece in text


def test_gemma4_pending_tool_call_waits_for_response(fixture_cache):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cached_model("gemma4")))
    text = tokenizer.apply_chat_template(tool_conversation()[:2], tools=TOOLS,
                                         add_generation_prompt=True, tokenize=False)
    # The model turn stays open at <|tool_response>, which is also an eos id.
    assert text.endswith('<tool_call|><|tool_response>')
    config = json.loads((cached_model("gemma4") / "config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|tool_response>") in config["eos_token_id"]


def test_cached_model_reuses_one_directory(fixture_cache):
    first = cached_model("gemma3")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_model("gemma3") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.parent == fixture_cache
    assert cached_model("gemma3", seed=1) != first
    bf16 = cached_model("gemma3", dtype="bfloat16")  # a directory of its own, bfloat16 weights
    assert bf16 != first
    assert {v.dtype for v in mx.load(str(bf16 / "model.safetensors")).values()} == {mx.bfloat16}
    # No temporary build directories are left behind.
    assert not [p for p in fixture_cache.iterdir() if p.name.startswith(".")]


def test_concurrent_cached_builds_agree(tmp_path):
    import subprocess
    import sys

    code = "from vlm_serve.fixtures.build import cached_model; print(cached_model('gemma3', seed=5))"
    env = {**os.environ, "VLM_SERVE_FIXTURE_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
             for _ in range(2)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(paths.pop())]


def test_cli_builds_a_model(tmp_path, capsys):
    build.main(["--arch", "gemma3", "--out", str(tmp_path / "m"), "--seed", "7"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    info = json.loads((tmp_path / "m" / "fixture.json").read_text())
    assert info["arch"] == "gemma3" and info["seed"] == 7 and info["preset"] == "tiny"


@pytest.mark.parametrize("arch, preset, billions", [
    ("gemma3", "gemma3-4b", (4.2, 4.4)),
    ("qwen2_5_vl", "qwen2_5_vl-7b", (8.2, 8.4)),
])
def test_real_size_presets_have_real_shapes(arch, preset, billions):
    """Shapes only: the bf16 weights are built on benchmark machines."""
    from vlm_serve.fixtures.tokenizer import pad_vocab, train_bpe
    from vlm_serve.fixtures.weights import parameter_shapes

    family = FAMILIES[arch]
    p = family.PRESETS[preset]
    assert p.dtype == "bfloat16"
    tok = pad_vocab(train_bpe(family.token_spec()), p.vocab_size)
    assert tok.get_vocab_size() == p.vocab_size
    assert tok.decode([p.vocab_size - 1])  # filler ids decode to text
    config = family.make_config(p, tok, p.vocab_size)
    shapes = parameter_shapes(config)
    for key in family.TIED:
        shapes.pop(key)
    total = sum(int(np.prod(s)) for s in shapes.values())
    assert billions[0] * 1e9 < total < billions[1] * 1e9
    embed = shapes["language_model.model.embed_tokens.weight"]
    assert embed[0] == p.vocab_size
