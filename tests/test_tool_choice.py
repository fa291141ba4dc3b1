"""tool_choice "required" and a named function, enforced by a grammar in every tool-call
format: a random-weight model, which unconstrained never writes a call, then always answers
with one valid call (over HTTP with the openai client; the grammars alone are tried in
test_tool_grammar.py)."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import openai
import pytest
from mlx_vlm import load as vlm_load

from vlm_serve.tools import get_parser
from vlm_serve.tools.grammar import enforces, tool_call_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}, "24h": {"type": "boolean"}},
            "required": ["zone", "24h"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


def check_arguments(name: str, arguments: str) -> None:
    """The arguments parse as JSON and follow the tool's schema (checked by hand: no
    jsonschema here)."""
    args = json.loads(arguments)
    assert isinstance(args, dict)
    if name == "get_weather":
        assert "city" in args and set(args) <= {"city", "days"}
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
        if "days" in args:
            assert isinstance(args["days"], int) and not isinstance(args["days"], bool) and 1 <= args["days"] <= 14
    else:
        assert name == "get_time" and set(args) == {"zone", "24h"}
        assert args["zone"] in ("UTC", "CET", "PST") and isinstance(args["24h"], bool)


def ask(server, model: str, tool_choice, seed: int, allowed: set[str]) -> None:
    client = server.client()
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
                  temperature=1.0, seed=seed)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name in allowed
    check_arguments(call.function.name, call.function.arguments)

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert {d.index for d in deltas} == {0}
    assert deltas[0].function.name == call.function.name
    arguments = "".join(d.function.arguments or "" for d in deltas)
    check_arguments(call.function.name, arguments)
    assert json.loads(arguments) == json.loads(call.function.arguments)  # same seed, same call
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


@pytest.fixture(scope="module")
def qwen(start_server):
    return start_server("qwen2_5_vl")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_a_valid_call_of_some_tool(qwen, seed):
    ask(qwen, "tiny-qwen2_5_vl", "required", seed, {"get_weather", "get_time"})


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_gives_a_valid_call_of_it(qwen, seed, name):
    ask(qwen, "tiny-qwen2_5_vl", {"type": "function", "function": {"name": name}}, seed, {name})


def test_auto_stays_unconstrained(qwen):
    r = qwen.client().chat.completions.create(model="tiny-qwen2_5_vl", messages=MESSAGES, tools=TOOLS,
                                              max_tokens=20, temperature=1.0, seed=1)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None


def test_response_format_with_enforced_tool_choice_is_refused(qwen):
    with pytest.raises(openai.BadRequestError) as info:
        qwen.client().chat.completions.create(model="tiny-qwen2_5_vl", messages=MESSAGES, tools=TOOLS,
                                              tool_choice="required", response_format={"type": "json_object"})
    assert info.value.status_code == 400 and info.value.body["param"] == "tool_choice"


# The fixture each format is served from, and the --tool-call-parser it needs where the
# fixture's template does not name the format (Mistral Small 3.1's, GLM-4.1V's and
# Kimi-VL's templates have no tool calls).
SERVED = {
    "mistral": ("mistral3", "mistral"),
    "gemma4": ("gemma4", None),
    "function_gemma": ("gemma3", "function_gemma"),
    "gemma3": ("gemma3", None),
    "glm4": ("glm4v", "glm4"),
    "kimi_k2": ("kimi_vl", "kimi_k2"),
}


@pytest.fixture(scope="module")
def served(start_server):
    """One server per format, started on first use."""
    servers = {}

    def get(fmt: str):
        if fmt not in servers:
            arch, parser = SERVED[fmt]
            servers[fmt] = start_server(arch, **({"tool_call_parser": parser} if parser else {}))
            assert servers[fmt].app.state.vlm.tool_parser.name == fmt
        return servers[fmt]

    return get


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("fmt", list(SERVED))
def test_every_format_is_enforced(served, fmt, tool_choice, seed):
    allowed = {"get_weather", "get_time"} if tool_choice == "required" else {"get_time"}
    ask(served(fmt), f"tiny-{SERVED[fmt][0]}", tool_choice, seed, allowed)


# Renders the tools it is given, but asks for no call format of any parser.
_TOOLS_WITHOUT_FORMAT = (
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_required_without_a_known_format_is_refused(start_server, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(_TOOLS_WITHOUT_FORMAT)
    server = start_server("kimi_vl", chat_template=str(template))
    assert server.app.state.vlm.tool_parser is None
    client = server.client()
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny-kimi_vl", messages=MESSAGES, tools=TOOLS, tool_choice=choice)
        assert info.value.body["param"] == "tool_choice" and "--tool-call-parser" in info.value.body["message"]
    auto = client.chat.completions.create(model="tiny-kimi_vl", messages=MESSAGES, tools=TOOLS, max_tokens=3,
                                          seed=1)  # unseeded, the tiny model sometimes samples its EOS first
    assert auto.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "arch, fmt, marker, text",
    [
        ("qwen2_5_vl", "hermes", "<tool_call>",
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "24h": true}}\n</tool_call>'),
        ("mistral3", "mistral", "[TOOL_CALLS]",
         '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC", "24h": true}}]'),
        ("qwen2_5_vl", "llama3_json", None, '{"name": "get_time", "parameters": {"zone": "UTC", "24h": true}}'),
    ],
)
def test_grammar_takes_the_markers_special_token_and_ends_after_the_call(model_path, arch, fmt, marker, text):
    _, processor = vlm_load(str(model_path(arch)))
    tok = processor.tokenizer

    def marker_token(t):
        ids = tok.encode(t, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    grammar = tool_call_grammar(fmt, TOOLS, marker_token)
    if marker is not None:
        assert f"<[{marker_token(marker)}]>" in grammar  # the single token, not its spelling
    llg_tok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    matcher = llguidance.LLMatcher(llg_tok, grammar)
    ids = tok.encode(text, add_special_tokens=False)
    assert matcher.consume_tokens(ids), matcher.get_error()
    assert matcher.is_stopped()  # nothing may follow the call
    [call] = get_parser(fmt).parse(text, {"get_weather", "get_time"}).tool_calls
    assert call.name == "get_time"
    # Prose and a wrong name are refused.
    assert not llguidance.LLMatcher(llg_tok, grammar).consume_tokens(tok.encode("Sure", add_special_tokens=False))
    wrong = text.replace("get_time", "get_weather")
    assert not llguidance.LLMatcher(llg_tok, tool_call_grammar(fmt, [CLOCK], marker_token)).consume_tokens(
        tok.encode(wrong, add_special_tokens=False))


def test_every_parsed_format_is_enforced_and_auto_is_not():
    named = {"type": "function", "function": {"name": "f"}}
    for fmt in ("hermes", "mistral", "llama3_json", "gemma4", "function_gemma", "gemma3", "glm4", "kimi_k2"):
        assert enforces(fmt, "required") and enforces(fmt, named)
        assert not enforces(fmt, "auto") and not enforces(fmt, "none")
    assert not enforces(None, "required")


def test_a_template_that_only_mentions_tools_gets_the_tool_code_prompt(start_server):
    # Kimi-VL's template says "no tools" in a comment and renders none: the tools go
    # into the prompt as tool_code instructions, and tool_choice is enforced in that form.
    server = start_server("kimi_vl")
    assert server.app.state.vlm.tool_parser is not None
    client = server.client()
    out = client.chat.completions.create(
        model="tiny-kimi_vl", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
    )
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in {"get_weather", "get_time"}
