"""Tool calls end to end: the corpus fed token by token through the fixture tokenizers
and the engine's streaming detokenizer, and over HTTP with the openai client."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_vlm import load as vlm_load

from vlm_serve.api.output import OutputProcessor, merge_deltas
from vlm_serve.engine import sampling
from vlm_serve.engine.detokenize import TextAssembler, make_detokenizer
from vlm_serve.preprocess.media import MediaPolicy
from vlm_serve.preprocess.prompt import PromptContext, prepare_chat
from vlm_serve.engine.types import SamplingParams
from vlm_serve.tools import get_parser

from tool_corpus import load_corpus, tool_names_of

# Which fixture tokenizer carries each format's markers as tokens (or the family's
# tokenizer, where the fixture has no such tokens: the markers are then split by BPE).
TOKENIZER_ARCH = {"gemma4": "gemma4", "function_gemma": "gemma3", "gemma3": "gemma3", "hermes": "qwen2_5_vl",
                  "mistral": "mistral3", "llama3_json": "mllama", "glm4": "glm4v", "kimi_k2": "kimi_vl"}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tokenizers(model_path):
    out = {}
    for arch in sorted(set(TOKENIZER_ARCH.values())):
        path = model_path(arch)
        _, processor = vlm_load(str(path))
        out[arch] = (processor.tokenizer, make_detokenizer(path, processor.tokenizer))
    return out


@pytest.mark.parametrize("fmt", list(TOKENIZER_ARCH))
def test_corpus_token_by_token_through_detokenizer(fmt, tokenizers):
    tokenizer, detok = tokenizers[TOKENIZER_ARCH[fmt]]
    parser = get_parser(fmt)
    for case in load_corpus(fmt):
        ids = tokenizer.encode(case["text"], add_special_tokens=False)
        text = TextAssembler(detok, [])
        output = OutputProcessor(tools=parser.streaming(tool_names_of(case)))
        deltas, decoded = [], ""
        for token in ids:
            piece = text.add_token(token)
            decoded += piece
            deltas += output.feed(piece)
        piece = text.finish()
        decoded += piece
        deltas += output.feed(piece) + output.finish()
        message = merge_deltas(deltas)
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
        assert calls == [(c["name"], c["arguments"]) for c in case["calls"]], case["id"]
        # mlx-lm's detokenizer drops one leading space of a generation; content is then
        # compared with the parse of what it did produce.
        expected = case["content"] if decoded == case["text"] else parser.parse(decoded, tool_names_of(case)).content
        assert decoded.lstrip(" ") == case["text"].lstrip(" "), case["id"]
        assert (message["content"] or "") == expected, case["id"]


def steer_to(monkeypatch, token_ids: list[int]) -> None:
    """Make every row sample ``token_ids`` in order: the model still runs its real forward
    passes, only the sampled token is replaced (a random-weight model cannot be asked to
    write a tool call)."""
    original = sampling.BatchSampler.sample

    def steered(self, logits, allowed=None):
        out = original(self, logits, allowed)
        forced = [token_ids[min(n - 1, len(token_ids) - 1)] for n in self.positions]
        return sampling.SampleOutput(tokens=mx.array(forced, mx.int32), logprobs=out.logprobs)

    monkeypatch.setattr(sampling.BatchSampler, "sample", steered)


@pytest.fixture
def gemma4_server(start_server):
    return start_server("gemma4")


@pytest.fixture
def gemma3_server(start_server):
    return start_server("gemma3")


def _answer_ids(server, text: str, end_token: str) -> list[int]:
    tokenizer = server.engine.loaded.tokenizer
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(end_token)]


@pytest.mark.parametrize(
    "arch, text, end, overrides",
    [
        ("gemma4", 'Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>', "<|tool_response>", {}),
        ("gemma3", 'Let me check.\n```tool_code\nget_weather(city="Paris", days=3)\n```', "<end_of_turn>", {}),
        ("qwen2_5_vl", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
                       "</tool_call>", "<|im_end|>", {}),
        # Mistral Small 3.1's HF template has no tools: the format is named explicitly.
        ("mistral3", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', "</s>",
         {"tool_call_parser": "mistral"}),
    ],
    ids=["gemma4", "gemma3", "qwen2_5_vl-hermes", "mistral3-mistral"],
)
def test_tool_calls_over_http_streamed_and_not(arch, text, end, overrides, start_server, monkeypatch):
    server = start_server(arch, **overrides)
    steer_to(monkeypatch, _answer_ids(server, text, end))
    client = server.client()
    messages = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]
    r = client.chat.completions.create(model=f"tiny-{arch}", messages=messages, tools=[WEATHER_TOOL], max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    chunks = list(client.chat.completions.create(model=f"tiny-{arch}", messages=messages, tools=[WEATHER_TOOL],
                                                 max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    call_deltas = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert content == "Let me check."
    assert call_deltas[0].index == 0 and call_deltas[0].id.startswith("call_")
    assert call_deltas[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in call_deltas)) == {"city": "Paris", "days": 3}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    # Without tools in the request the same text is plain content.
    plain = client.chat.completions.create(model=f"tiny-{arch}", messages=messages, max_tokens=200)
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None

    # The tool result goes back and the conversation continues.
    followup = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "clear"})},
    ]
    again = client.chat.completions.create(model=f"tiny-{arch}", messages=followup, tools=[WEATHER_TOOL], max_tokens=200)
    assert again.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("arch, expect", [("gemma4", "<|tool_response>response:get_weather{"),
                                          ("gemma3", "```tool_output\n")])
def test_tool_result_renders_into_next_prompt(arch, expect, model_path):
    path = model_path(arch)
    _, processor = vlm_load(str(path))
    ctx = PromptContext(processor, arch, MediaPolicy(), 4, chat_template=processor.tokenizer.chat_template)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": 21}'},
    ]
    prepared = prepare_chat(ctx, "r", messages, SamplingParams(), [WEATHER_TOOL])
    prompt = processor.tokenizer.decode(prepared.input_ids.tolist())
    assert expect in prompt
    assert "21" in prompt.split(expect, 1)[1]
    assert "get_weather" in prompt


def test_gemma3_template_without_tool_support_gets_documented_prompt(model_path):
    """A real Gemma 3 template ignores ``tools``; the server then writes Google's
    documented function-calling prompt into the first user turn itself."""
    path = model_path("gemma3")
    _, processor = vlm_load(str(path))
    plain = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] if m['content'] is string else m['content'][0]['text'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
    processor.tokenizer.chat_template = plain
    ctx = PromptContext(processor, "gemma3", MediaPolicy(), 4, chat_template=plain)
    prepared = prepare_chat(ctx, "r", [{"role": "user", "content": "Weather in Paris?"}], SamplingParams(), [WEATHER_TOOL])
    prompt = processor.tokenizer.decode(prepared.input_ids.tolist())
    assert "```tool_code" in prompt and '"name": "get_weather"' in prompt
    assert prompt.index("get_weather") < prompt.index("Weather in Paris?")
