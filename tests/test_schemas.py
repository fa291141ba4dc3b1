"""Request validation into sampling parameters."""

import json

import pytest

from vlm_serve.api.errors import APIError
from vlm_serve.api.schemas import decode_json, parse_chat_request, sampling_from

MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "top_k": 64}


def test_model_defaults_fill_missing_fields_only():
    params, max_tokens = sampling_from({}, 100, MODEL_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.95, 64)
    assert max_tokens is None
    params, _ = sampling_from({"temperature": 0, "top_k": 5}, 100, MODEL_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k) == (0, 0.95, 5)


def test_openai_defaults_without_model_defaults():
    params, _ = sampling_from({"max_completion_tokens": 7}, 100)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 7)


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"500": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"stop": [1, 2]}, "stop"),
    ({"seed": "abc"}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
])
def test_invalid_fields_name_their_param(body, param):
    with pytest.raises(APIError) as info:
        parse_chat_request({"messages": [{"role": "user", "content": "x"}], **body}, 100)
    assert info.value.status == 400 and info.value.param == param


def test_tool_choice_none_hides_tools_and_named_shows_one():
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    base = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    assert parse_chat_request(base, 100).active_tools == tools
    assert parse_chat_request({**base, "tool_choice": "none"}, 100).active_tools == []
    named = parse_chat_request({**base, "tool_choice": {"type": "function", "function": {"name": "b"}}}, 100)
    assert named.active_tools == [tools[1]]


@pytest.mark.parametrize("text", [
    '{"a": 1, "a": 2}',  # the last duplicate wins, as in the standard library
    '{"x": [true, false, null, -0.0, 1E2, 1.5e-320, 1e308, 18446744073709551615]}',
    '{"seed": 1180591620717411303424}',  # beyond 64 bits: the standard library decodes it
    '"\\u00e9\\ud83d\\ude00 caf\\u00e9"',
    '\ufeff{"bom": 1}',  # a UTF-8 byte order mark
    ' {"url": "data:image/png;base64,' + "QUJD" * 50_000 + '"} ',
])
def test_decoded_bodies_equal_the_standard_librarys(text):
    """Bodies are decoded by msgspec, or by the standard library where msgspec refuses
    them: either way the result is what ``json.loads`` gives."""
    raw = text.encode()
    assert decode_json(raw) == json.loads(raw)


def test_bodies_msgspec_refuses_get_the_standard_librarys_errors():
    with pytest.raises(APIError) as nan:
        decode_json(b'{"temperature": NaN}')
    assert nan.value.param == "temperature"
    with pytest.raises(APIError) as surrogate:
        decode_json(b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert surrogate.value.param == "messages[0].content"
    with pytest.raises(APIError) as utf16:
        decode_json('{"a": NaN}'.encode("utf-16"))
    assert utf16.value.param == "a"
    with pytest.raises(APIError) as bad_utf8:
        decode_json(b'{"user": "\xff"}')
    assert bad_utf8.value.code == "invalid_json"
