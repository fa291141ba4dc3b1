"""response_format: JSON mode and JSON Schema through llguidance, over HTTP and beside
unconstrained rows in one batch."""

from __future__ import annotations

import json

import pytest

from vlm_serve.engine.grammar import json_grammar
from vlm_serve.engine.types import FinishReason

from test_parity import Case, _assert_matches_oracle, _cases, harness, run_jobs  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


def check(value: dict) -> None:
    assert set(value) == {"color", "count", "ok"}
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["count"], int) and 0 <= value["count"] <= 99
    assert isinstance(value["ok"], bool)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("gemma3")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_is_valid_streamed_and_not(server, seed):
    client = server.client()
    messages = [{"role": "user", "content": "Describe a thing as JSON."}]
    r = client.chat.completions.create(model="tiny-gemma3", messages=messages, response_format=FORMAT,
                                       max_tokens=60, temperature=1.0, seed=seed)
    assert r.choices[0].finish_reason == "stop"
    check(json.loads(r.choices[0].message.content))
    chunks = client.chat.completions.create(model="tiny-gemma3", messages=messages, response_format=FORMAT,
                                            max_tokens=60, temperature=1.0, seed=seed, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


def test_json_object_mode_starts_an_object(server):
    r = server.client().chat.completions.create(
        model="tiny-gemma3", messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    content = r.choices[0].message.content
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_constrained_row_beside_unconstrained_rows_in_one_batch(harness):  # noqa: F811 - the fixture
    """Unconstrained rows keep the oracle's tokens while a grammar row runs beside them
    (the batch then reads every step back before queuing the next)."""
    cases = _cases()[:4]
    constrained = harness.prepare(Case("json", "Describe a thing as JSON."), "json", seed=5)
    constrained.sampling.temperature, constrained.sampling.max_tokens = 1.0, 60
    constrained.sampling.grammar = json_grammar(FORMAT)
    jobs = [(constrained, None, None)] + [(harness.prepare(c, c.name), None, None) for c in cases]
    results = run_jobs(harness.engine, jobs)
    assert results["json"]["finish"] == FinishReason.STOP
    check(json.loads(results["json"]["text"]))
    for case in cases:
        _assert_matches_oracle(harness, case, results[case.name])
