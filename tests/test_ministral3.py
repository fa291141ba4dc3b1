"""Mistral 3 with a Ministral 3 text model: batched rows equal each row decoded alone.

Ministral 3 scales its queries by ``1 + beta * log(1 + floor(position / N))``
(N: original_max_position_embeddings), so each row's scale follows its own position.
The fixture's N is 32: rows of different lengths, decoded together, cross multiples of
32 at different steps and hold different scales at every step; sliding-window layers
(window 24, shorter than every prompt but the raw ones) sit beside full ones.

The oracle is mlx-vlm's ``generate_step`` on a separately loaded copy of the model, one
request at a time, fed the same token ids and processor outputs as the engine.
"""

from __future__ import annotations


import pytest
from mlx_vlm import load as vlm_load

from vlm_serve.engine.decode.ministral3 import Ministral3Decoder
from vlm_serve.fixtures.build import cached_model

from conftest import make_image
from oracle import FullLengthHarness, assert_each_matches_alone
from test_parity import LONG_TEXT, run_jobs
# The family suite (mixed batches with joins, bursts, prefix reuse) on this fixture too.
from test_families import (  # noqa: F401 - collected here with this module's `family`
    FamilyHarness,
    test_burst_prefilled_together_matches_mlx_vlm,
    test_image_chat_turn_two_reuses_its_prefix_and_matches_mlx_vlm,
    test_mixed_batch_with_joining_rows_matches_mlx_vlm,
    test_prompts_of_different_lengths_share_a_padded_last_pass,
    test_text_prompt_extending_a_cached_one_matches_mlx_vlm,
)

PREFILL_STEP = 32
PRESET = "tiny-ministral3"
THRESHOLD = 32  # the fixture's original_max_position_embeddings


@pytest.fixture(scope="module", params=[None, 4], ids=["f32", "q4"])
def harness(request):
    # Every row runs its full length: the threshold crossings are the point.
    h = FullLengthHarness(str(cached_model("mistral3", preset=PRESET, bits=request.param)), PREFILL_STEP)
    yield h
    h.shutdown()


@pytest.fixture(scope="module", params=[None, 4], ids=["f32", "q4"])
def family(request):
    h = FamilyHarness("mistral3", request.param, preset=PRESET)
    yield h
    h.shutdown()


def test_fixture_is_ministral3_with_windows_and_a_small_threshold(harness):
    text = harness.oracle_model.language_model.model
    assert type(text).__name__ == "Ministral3"
    assert {layer.use_sliding for layer in text.layers} == {True, False}
    params = text.config.rope_parameters
    assert params["original_max_position_embeddings"] == THRESHOLD
    assert params["llama_4_scaling_beta"] > 0


def test_rows_crossing_the_scale_threshold_at_different_steps_match_alone(harness):
    h = harness
    jobs = [
        # Raw prompts of a few tokens: they cross 32 (scale 1 -> 1 + beta log 2), and
        # the window fills, while decoding.
        (h.prepare("raw-short", "Hi", chat=False, max_tokens=44), None, None),
        (h.prepare("raw-mid", LONG_TEXT[:60], chat=False, max_tokens=40), None, None),
        # Chat prompts: hundreds of tokens, each at its own offset from a multiple of 32.
        (h.prepare("chat-short", "Hi!"), None, None),
        (h.prepare("chat-image", "Describe this picture.", [make_image(60, 40, 1)]), None, None),
        (h.prepare("chat-long", LONG_TEXT[:300] + " Summarise.", max_tokens=36), None, None),
        # Joining mid-decode, so the batch's first row is not the oldest.
        (h.prepare("late-text", "What colours are here, and why?", max_tokens=30),
         ("raw-short", 9), None),
        (h.prepare("late-image", "Read it.", [make_image(90, 120, 2)], max_tokens=30),
         ("chat-short", 17), None),
    ]
    results = run_jobs(h.engine, jobs)
    assert type(h.engine.scheduler.batch.decoder) is Ministral3Decoder
    assert h.engine.scheduler.peak_running >= 5  # the rows really shared decode steps
    crossings = set()
    expected = assert_each_matches_alone(jobs, results, h.oracle)
    for prepared, _, _ in jobs:
        start, tokens = len(prepared.input_ids), expected[prepared.request_id]
        crossings |= {p // THRESHOLD for p in (start, start + len(tokens) - 1)}
    # The rows span several scale levels.
    assert len(crossings) >= 4


def test_without_its_engine_step_it_is_served_one_row_at_a_time(monkeypatch, caplog):
    """mlx-vlm's Ministral 3 code on a batch cache is not exact (the first row's scale),
    so if the engine step cannot be built the model is not batched."""
    from vlm_serve.engine.families import family_for

    def refuse(self, model):
        raise TypeError("an unusual layout")

    monkeypatch.setattr(Ministral3Decoder, "__init__", refuse)
    model, _ = vlm_load(str(cached_model("mistral3", preset=PRESET)))
    with caplog.at_level("WARNING", logger="vlm_serve.engine"):
        family = family_for(model)
    assert not family.batched
    assert "one request at a time" in family.describe()
    assert "one request at a time" in caplog.text


def test_a_mistral4_text_model_is_served_one_row_at_a_time():
    """Mistral 4's model code scales queries the same way (the first row's position on
    a batch cache) and has no engine step: never batched."""
    from types import SimpleNamespace

    from vlm_serve.engine.families import SerialFamily, family_for

    text = type("Mistral4Model", (), {})()
    config = SimpleNamespace(rope_parameters={"llama_4_scaling_beta": 0.1})
    model = SimpleNamespace(config=SimpleNamespace(model_type="mistral3", image_token_index=10),
                            language_model=SimpleNamespace(model=text, config=config))
    family = family_for(model)
    assert isinstance(family, SerialFamily) and not family.batched
    assert "Mistral4Model" in family.describe() and "one request at a time" in family.describe()
