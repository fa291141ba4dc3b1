"""The tool_choice grammars of every format, without a model: random walks through each
grammar's token masks (the fixture tokenizers, llguidance's real matcher) always end in
exactly one call that the format's own parser reads back, with arguments that follow the
tool's schema; and texts that break the format or the schema are refused."""

from __future__ import annotations

import json
import random

import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
from mlx_vlm import load as vlm_load

from schema_check import schema_errors
from test_tool_choice import TOOLS
from vlm_serve.tools import get_parser, tool_signatures
from vlm_serve.tools.grammar import ENFORCED_FORMATS, tool_call_grammar

# The fixture whose tokenizer each format is tried with: Gemma 4's and FunctionGemma's
# markers are single tokens there, GLM's and Kimi's are plain text (split by BPE).
TOKENIZER_ARCH = {"gemma4": "gemma4", "function_gemma": "gemma3", "gemma3": "gemma3", "glm4": "glm4v",
                  "kimi_k2": "kimi_vl", "hermes": "qwen2_5_vl", "mistral": "mistral3", "llama3_json": "qwen2_5_vl"}

# Nested objects, a local $ref, arrays with bounds, typed and untyped enums, a type list,
# anyOf, and a property name that is not a plain word.
TRIP = {
    "type": "function",
    "function": {
        "name": "book_trip",
        "parameters": {
            "type": "object",
            "properties": {
                "traveller": {"$ref": "#/$defs/person"},
                "legs": {
                    "type": "array", "minItems": 1, "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {"from": {"type": "string", "maxLength": 5},
                                       "to": {"type": "string", "minLength": 1, "maxLength": 5},
                                       "day": {"type": "integer", "minimum": 1, "maximum": 31}},
                        "required": ["from", "to"], "additionalProperties": False,
                    },
                },
                "class": {"type": "string", "enum": ["economy", "business"]},
                "budget": {"type": ["number", "null"], "minimum": 0, "maximum": 5000},
                "notes": {"type": "string", "maxLength": 8},
                "flexible dates": {"type": "boolean"},
                "seat": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 60},
                                   {"type": "string", "enum": ["aisle", "window"]}]},
            },
            "required": ["traveller", "legs", "class"],
            "additionalProperties": False,
            "$defs": {"person": {"type": "object",
                                 "properties": {"name": {"type": "string", "maxLength": 6},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                                 "required": ["name"], "additionalProperties": False}},
        },
    },
}
NO_ARGS = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
ALL_TOOLS = TOOLS + [TRIP, NO_ARGS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in ALL_TOOLS}


@pytest.fixture(scope="module")
def tokenizers(model_path):
    out = {}
    for arch in sorted(set(TOKENIZER_ARCH.values())):
        tok = vlm_load(str(model_path(arch)))[1].tokenizer
        out[arch] = (tok, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id]))
    return out


def marker_token_of(tok):
    def marker_token(text: str) -> int | None:
        ids = tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None
    return marker_token


def random_walk(matcher, vocab: int, rng: random.Random, limit: int = 600) -> list[int]:
    """Tokens picked uniformly among those the grammar allows, until it stops."""
    ids = []
    while not matcher.is_stopped():
        assert len(ids) < limit, "the grammar did not end"
        bits = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
        llg_numpy.fill_next_token_bitmask(matcher, bits, 0)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab])
        token = int(rng.choice(list(allowed)))
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
    return ids


def test_every_parsed_format_is_enforced():
    assert ENFORCED_FORMATS == set(TOKENIZER_ARCH)


@pytest.mark.parametrize("fmt", list(TOKENIZER_ARCH))
def test_random_walks_give_one_valid_call(fmt, tokenizers):
    tok, llg_tok = tokenizers[TOKENIZER_ARCH[fmt]]
    parser = get_parser(fmt)
    rng = random.Random(fmt)
    seen = set()
    for tools in ([*ALL_TOOLS], [TRIP], [NO_ARGS]):
        grammar = tool_call_grammar(fmt, tools, marker_token_of(tok))
        for _ in range(12):
            text = tok.decode(random_walk(llguidance.LLMatcher(llg_tok, grammar), len(tok), rng))
            out = parser.parse(text, tool_signatures(tools))
            assert len(out.tool_calls) == 1 and out.content == "", text
            [call] = out.tool_calls
            assert call.name in {t["function"]["name"] for t in tools}, text
            args = json.loads(call.arguments)
            assert schema_errors(args, SCHEMAS[call.name]) == [], text
            # Streaming token by token reads the same call.
            stream = parser.streaming(tool_signatures(tools))
            events = [e for i in range(len(text)) for e in stream.feed(text[i])] + stream.finish()
            assert json.loads("".join(e.arguments or "" for e in events if hasattr(e, "arguments"))) == args
            seen.add(call.name)
    assert {"book_trip", "ping"} <= seen


# A valid call of get_time in each format, and its parts that the tests below break.
VALID = {
    "gemma4": '<|tool_call>call:get_time{24h:true,zone:<|"|>UTC<|"|>}<tool_call|>',
    "function_gemma": "<start_function_call>call:get_time{24h:true,zone:<escape>UTC<escape>}<end_function_call>",
    "gemma3": '```tool_code\nget_time(zone="UTC", 24h=true)\n```',
    "glm4": "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>\"UTC\"</arg_value>\n"
            "<arg_key>24h</arg_key>\n<arg_value>true</arg_value>\n</tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
               '{"zone": "UTC", "24h": true}<|tool_call_end|><|tool_calls_section_end|>',
}


def accepts(tokenizers, fmt: str, tools, text: str) -> bool:
    tok, llg_tok = tokenizers[TOKENIZER_ARCH[fmt]]
    matcher = llguidance.LLMatcher(llg_tok, tool_call_grammar(fmt, tools, marker_token_of(tok)))
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_stopped()


@pytest.mark.parametrize("fmt", list(VALID))
def test_valid_call_accepted_and_broken_ones_refused(fmt, tokenizers):
    text = VALID[fmt]
    assert accepts(tokenizers, fmt, TOOLS, text)
    [call] = get_parser(fmt).parse(text, tool_signatures(TOOLS)).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"zone": "UTC", "24h": True})
    broken = {
        "prose first": "Sure. " + text,
        "text after": text + " Done.",
        "undeclared name": text.replace("get_time", "get_clock"),
        "named tool is another": None,
        "value outside the enum": text.replace("UTC", "EST"),
        "boolean as a string": text.replace("true", '"yes"' if fmt in ("kimi_k2", "glm4", "gemma3") else "yes"),
        "a second call": text + text,
    }
    for why, bad in broken.items():
        if why == "named tool is another":
            assert not accepts(tokenizers, fmt, [TOOLS[0]], text), why
        else:
            assert not accepts(tokenizers, fmt, TOOLS, bad), why


@pytest.mark.parametrize("fmt, text", [
    # A string may not hold a marker the parser would take as the end of the call.
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>a<tool_call|>b<|"|>}<tool_call|>'),
    ("function_gemma", "<start_function_call>call:get_weather{city:<escape>a<end_function_call><escape>}"
                       "<end_function_call>"),
    ("glm4", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a</tool_call></arg_value>\n</tool_call>"),
    # Over the schema's maxLength (12).
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris is lovely<|"|>}<tool_call|>'),
    ("glm4", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris is lovely</arg_value>\n</tool_call>"),
    # A required argument left out, an undeclared one added.
    ("gemma3", '```tool_code\nget_weather(days=3)\n```'),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,country:<|"|>FR<|"|>}<tool_call|>'),
])
def test_markers_bounds_and_names_follow_the_schema(fmt, text, tokenizers):
    assert not accepts(tokenizers, fmt, TOOLS, text)


def test_glm4_string_values_are_raw_text(tokenizers):
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    assert accepts(tokenizers, "glm4", TOOLS, text)
    assert not accepts(tokenizers, "glm4", TOOLS, text.replace("Paris", '"Paris"'.ljust(14, "x")))


@pytest.mark.parametrize("fmt, name", [("gemma3", "7zip"), ("gemma4", "a b"), ("kimi_k2", "functions.x"),
                                       ("glm4", "a\nb")])
def test_a_name_the_format_cannot_write_is_refused(fmt, name):
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(ValueError, match="cannot write the function name"):
        tool_call_grammar(fmt, [tool], lambda text: None)
