"""Batched generation equals single-request generation.

The oracle is mlx-vlm's own ``stream_generate`` on a separately loaded copy of the same
tiny model, one request at a time; greedy decoding in float32 on the CPU. Every request
of a mixed batch must produce exactly the oracle's tokens.

On CUDA the engine computes with kernels of its own (attention, and the row-exact
matmul), whose sums round otherwise than mlx-vlm's, so the oracle there is a second
engine serving one request at a time: the promise is the same tokens batched as alone.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm import load as vlm_load
from mlx_vlm import stream_generate

from vlm_serve.engine.engine import Engine
from vlm_serve.engine.model_inputs import model_arrays
from vlm_serve.engine.scheduler import SchedulerConfig
from vlm_serve.engine.tower_sharing import cut
from vlm_serve.engine.types import FinishReason, SamplingParams
from vlm_serve.preprocess.media import MediaPolicy
from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat

from conftest import ARCHS, make_image, wait_until
from oracle import engine_alone_on_cuda

PREFILL_STEP = 32  # small, so long prompts are prefilled in several interleaved chunks

LONG_TEXT = " ".join(
    f"Sentence {i} tells of a {w} that crossed the river at dawn." for i, w in
    enumerate(["fox", "heron", "barge", "cloud", "rider", "lantern", "kite", "wolf"] * 4)
)


@dataclass
class Case:
    name: str
    text: str
    images: list = field(default_factory=list)
    max_tokens: int = 12
    stop: list[str] = field(default_factory=list)
    text_first: bool = False  # the text before the images in the message


def chat_prompt(ctx: PromptContext, case: Case) -> str:
    parts = [{"type": "image"} for _ in case.images]
    text = [{"type": "text", "text": case.text}]
    return render_chat(ctx, [{"role": "user", "content": text + parts if case.text_first else parts + text}])


class Harness:
    """An engine and an oracle copy of one architecture's tiny model."""

    def __init__(self, path: str, max_num_seqs: int = 16):
        # A budget of one chunk: long prompts are prefilled across several decode steps.
        config = SchedulerConfig(max_num_seqs=max_num_seqs, prefill_step_size=PREFILL_STEP,
                                 prefill_token_budget=PREFILL_STEP)
        self.engine = Engine(path, config)
        self.engine.start()
        loaded = self.engine.loaded
        self.ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 8, loaded.chat_template)
        self.oracle_model, self.oracle_processor = vlm_load(path)
        self._oracle_cache: dict = {}
        self.alone = engine_alone_on_cuda(path, PREFILL_STEP)

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.alone is not None:
            self.alone.shutdown()

    def prepare(self, case: Case, rid: str, **sampling):
        params = SamplingParams(max_tokens=case.max_tokens, temperature=0.0, stop=case.stop, **sampling)
        return prepare_prompt(self.ctx, rid, chat_prompt(self.ctx, case), params, case.images)

    def oracle(self, case: Case) -> list[int]:
        key = (case.name, case.max_tokens)
        if key not in self._oracle_cache and self.alone is not None:
            self._oracle_cache[key] = self.alone(self.prepare(case, case.name))
        if key not in self._oracle_cache:
            final = None
            for result in stream_generate(
                self.oracle_model, self.oracle_processor, chat_prompt(self.ctx, case),
                image=case.images or None, max_tokens=case.max_tokens, temperature=0.0,
                prefill_step_size=PREFILL_STEP,
            ):
                final = result
            self._oracle_cache[key] = list(final.token_ids)
        return self._oracle_cache[key]

    def oracle_text(self, case: Case) -> str:
        return self.oracle_processor.tokenizer.decode(self.oracle(case))


async def _run(engine: Engine, jobs):
    """Run jobs: (prepared, start_after, cancel_after). ``start_after`` = (rid, n): submit
    once request rid has produced n tokens. ``cancel_after`` = n tokens, or None."""
    progress: dict[str, asyncio.Event] = {}
    results: dict[str, dict] = {}

    async def one(prepared, start_after, cancel_after):
        if start_after:
            await progress[f"{start_after[0]}:{start_after[1]}"].wait()
        tokens, text, final = [], "", None
        async for event in engine.submit(prepared):
            tokens += event.token_ids
            text += event.text
            final = event
            key = f"{prepared.request_id}:{len(tokens)}"
            if key in progress:
                progress[key].set()
            if cancel_after is not None and len(tokens) >= cancel_after and not event.finished:
                engine.cancel(prepared.request_id)
        for key, ev in progress.items():
            if key.startswith(prepared.request_id + ":"):
                ev.set()  # never leave a waiter hanging
        results[prepared.request_id] = {"tokens": tokens, "text": text, "finish": final.finish_reason, "error": final.error,
                                        "cached": (final.stats or {}).get("cached_tokens")}

    for _, start_after, _ in jobs:
        if start_after:
            progress[f"{start_after[0]}:{start_after[1]}"] = asyncio.Event()
    await asyncio.wait_for(asyncio.gather(*(one(*job) for job in jobs)), timeout=300)
    return results


def run_jobs(engine, jobs):
    return asyncio.run(_run(engine, jobs))


@pytest.fixture(scope="module", params=ARCHS)
def harness(request, model_path):
    h = Harness(str(model_path(request.param)))
    yield h
    h.shutdown()


def _cases() -> list[Case]:
    return [
        Case("image-small", "Describe this picture.", [make_image(40, 60, 1)], max_tokens=14),
        Case("text-short", "Hi!", max_tokens=9),
        Case("image-wide", "What colours are here, and why?", [make_image(96, 48, 2)], max_tokens=16),
        Case("two-images", "Compare the two images.", [make_image(56, 56, 3), make_image(30, 70, 4)], max_tokens=11),
        Case("text-long", LONG_TEXT + " Summarise.", max_tokens=13),
        Case("image-tall", "Read it.", [make_image(28, 90, 5)], max_tokens=5),
    ]


def _assert_matches_oracle(h: Harness, case: Case, result: dict) -> None:
    expected = h.oracle(case)
    assert result["error"] is None
    assert result["tokens"] == expected, (
        f"{case.name}: batched {result['tokens']} != oracle {expected}\n{divergence(h, case, result['tokens'], expected)}"
    )


def divergence(h: Harness, case: Case, got: list[int], expected: list[int]) -> str:
    """Top-2 logit gap of the oracle at the first differing position (near-tie check)."""
    i = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    from mlx_vlm.utils import prepare_inputs

    prompt = chat_prompt(h.ctx, case)
    inputs = prepare_inputs(h.oracle_processor, images=case.images or None, prompts=prompt)
    ids = mx.concatenate([inputs["input_ids"], mx.array([expected[:i]], mx.int32)], axis=1) if i else inputs["input_ids"]
    kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    emb = h.oracle_model.get_input_embeddings(ids, inputs.get("pixel_values"), mask=mx.ones(ids.shape), **kwargs)
    extra = {k: v for k, v in emb.to_dict().items() if k != "inputs_embeds" and v is not None}
    logits = h.oracle_model.language_model(ids, inputs_embeds=emb.inputs_embeds, **extra).logits[0, -1]
    top = mx.sort(logits)[-2:].tolist()
    return f"first divergence at token {i}; oracle top-2 logit gap there: {top[1] - top[0]:.6f}"


def test_each_request_alone_matches_oracle(harness):
    for case in _cases()[:3]:
        result = run_jobs(harness.engine, [(harness.prepare(case, case.name), None, None)])[case.name]
        _assert_matches_oracle(harness, case, result)
        assert result["finish"] in (FinishReason.LENGTH, FinishReason.STOP)


def test_a_slow_turn_is_logged_with_where_it_went(harness, caplog, monkeypatch):
    """A scheduler turn over SLOW_TURN_S is logged with its prefill, join and decode
    parts, and whether the KV store took new arrays (here every turn counts as slow:
    the lone row's join allocates the emptied store), and serving goes on as before."""
    from vlm_serve.engine import scheduler

    monkeypatch.setattr(scheduler, "SLOW_TURN_S", 0.0)
    monkeypatch.setattr(scheduler, "SLOW_TURN_LOG_S", 0.0)
    case = _cases()[0]
    with caplog.at_level("INFO", logger="vlm_serve.engine"):
        result = run_jobs(harness.engine, [(harness.prepare(case, "slow-turns"), None, None)])
    _assert_matches_oracle(harness, case, result["slow-turns"])
    turns = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow turn:")]
    assert any("prefill of" in t and "decode of 1 rows" in t for t in turns), turns
    if harness.engine.scheduler.batch.store is not None:
        reallocated = [t for t in turns if "the KV store reallocated to 1 slots" in t]
        assert len(reallocated) == 1, turns
    assert harness.engine.scheduler.stats()["slow_turns"] >= len(turns)


def test_the_stats_line_says_where_decode_turns_went(harness, caplog, monkeypatch):
    """The periodic engine line splits decode turns into building the step, queueing
    it, waiting for the one before, the rows' bookkeeping and finished rows leaving:
    parts of the turn."""
    import re

    monkeypatch.setattr(harness.engine.scheduler.config, "stats_interval_s", 0.0)
    cases = _cases()[:2]
    with caplog.at_level("INFO", logger="vlm_serve.engine"):
        results = run_jobs(harness.engine, [(harness.prepare(c, f"times-{c.name}"), None, None) for c in cases])
    for case in cases:
        _assert_matches_oracle(harness, case, results[f"times-{case.name}"])
    pattern = re.compile(r"(\d+) decode turns of (\d+) rows, ([\d.]+) ms a turn: build ([\d.]+), "
                         r"queue ([\d.]+), wait ([\d.]+), rows ([\d.]+), leave ([\d.]+), other (-?[\d.]+) ms")
    lines = [m for r in caplog.records if (m := pattern.search(r.getMessage()))]
    assert lines, [r.getMessage() for r in caplog.records]
    assert any(float(m.group(2)) >= 1 for m in lines)  # turns that decoded rows
    # The line also says MLX's buffer-cache cap while rows are served.
    assert any(re.search(r"mlx_cache_cap=[\d.]+ \w+ \(trimmed \d+ times\)", r.getMessage()) for r in caplog.records)
    for m in lines:
        turns, rows, turn, *parts, other = (float(g) for g in m.groups())
        assert turns >= 1 and 0 <= rows <= len(cases)
        assert all(p >= 0 for p in parts) and other >= -0.05  # printed to a tenth of a ms
        assert abs(turn - sum(parts) - other) < 0.4  # seven numbers rounded to 0.1


def test_mixed_batch_matches_oracle(harness):
    cases = _cases()
    jobs = [(harness.prepare(c, c.name), None, None) for c in cases]
    results = run_jobs(harness.engine, jobs)
    for case in cases:
        _assert_matches_oracle(harness, case, results[case.name])


def test_rows_joining_mid_decode_match_oracle(harness):
    cases = _cases()
    first, later = cases[1], cases
    jobs = [(harness.prepare(Case("first", first.text, max_tokens=30), "first"), None, None)]
    for i, case in enumerate(later):
        jobs.append((harness.prepare(case, f"late-{case.name}"), ("first", 2 + 3 * i), None))
    results = run_jobs(harness.engine, jobs)
    _assert_matches_oracle(harness, Case("first", first.text, max_tokens=30), results["first"])
    for case in later:
        _assert_matches_oracle(harness, case, results[f"late-{case.name}"])


def test_cancelled_rows_leave_and_others_match_oracle(harness):
    cases = _cases()[:4]
    long = Case("long-cancel", "Tell me a long story about rivers.", max_tokens=40)
    jobs = [(harness.prepare(c, c.name), None, None) for c in cases]
    jobs.append((harness.prepare(long, "cancel-me"), None, 3))
    results = run_jobs(harness.engine, jobs)
    assert results["cancel-me"]["finish"] == FinishReason.CANCELLED
    assert 3 <= len(results["cancel-me"]["tokens"]) < 40
    for case in cases:
        _assert_matches_oracle(harness, case, results[case.name])
    wait_until(lambda: harness.engine.scheduler.running == [])


def test_stop_strings_cut_text_and_rows_finish_early(harness):
    base = Case("stop-base", "Describe this picture.", [make_image(40, 60, 1)], max_tokens=14)
    text = harness.oracle_text(base)
    # A stop string from the middle of the oracle's text, possibly spanning tokens.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("oracle text too uniform to pick a stop string")
    stopped = Case("stop-base", base.text, base.images, max_tokens=14, stop=[stop])
    others = _cases()[1:4]
    jobs = [(harness.prepare(stopped, "stopped"), None, None)] + [
        (harness.prepare(c, c.name), None, None) for c in others
    ]
    results = run_jobs(harness.engine, jobs)
    assert results["stopped"]["finish"] == FinishReason.STOP
    assert results["stopped"]["text"] == text[: text.find(stop)]
    assert stop not in results["stopped"]["text"]
    for case in others:
        _assert_matches_oracle(harness, case, results[case.name])


def test_seeded_sampling_same_alone_and_batched(harness):
    case = Case("seeded", "Write anything you like.", [make_image(40, 40, 7)], max_tokens=16)
    sampling = dict(seed=1234)

    def seeded(rid):
        p = harness.prepare(case, rid, **sampling)
        p.sampling.temperature, p.sampling.top_p = 0.9, 0.95
        return p

    alone = run_jobs(harness.engine, [(seeded("alone"), None, None)])["alone"]["tokens"]
    noisy = []
    for i, c in enumerate(_cases()[:4]):
        p = harness.prepare(c, f"noise-{i}", seed=None)
        p.sampling.temperature, p.sampling.top_k = 1.0, 5
        noisy.append((p, None, None))
    batched = run_jobs(harness.engine, [(seeded("batched"), None, None)] + noisy)["batched"]["tokens"]
    assert alone == batched
    again = run_jobs(harness.engine, [(seeded("again"), None, None)])["again"]["tokens"]
    assert again == alone


def test_a_batch_of_joining_rows_only_reads_first_tokens_before_any_decode_step(harness, monkeypatch):
    """A prompt that joins a batch with no other row (idle, or its last rows just
    left) has its first token read back before the batch's next decode step is built:
    a one-token request ends with no decode step at all, and a longer one still gives
    the oracle's tokens."""
    steps = []
    monkeypatch.setattr(harness.engine.scheduler, "fault_hook",
                        lambda phase, states: steps.append(len(states)) if phase == "decode" else None)
    one = Case("one-token", "Say one word.", max_tokens=1)
    result = run_jobs(harness.engine, [(harness.prepare(one, "one-token"), None, None)])["one-token"]
    _assert_matches_oracle(harness, one, result)
    assert steps == []
    more = Case("more-tokens", "Say one word.", max_tokens=5)
    result = run_jobs(harness.engine, [(harness.prepare(more, "more-tokens"), None, None)])["more-tokens"]
    _assert_matches_oracle(harness, more, result)
    assert steps and set(steps) == {1}


def test_repeated_images_reuse_vision_features_and_match_oracle(harness, monkeypatch):
    """A conversation resends its image every turn: the second time the vision tower
    does not run (its features come from the vision cache, or the prefix cache holds
    the image's KV already) and the tokens are still the oracle's."""
    family = harness.engine.scheduler.family
    towers, encode = [], family.encode_images
    monkeypatch.setattr(family, "encode_images", lambda *args: towers.append(args) or encode(*args))
    case = Case("repeat-image", "What is in the picture?", [make_image(48, 40, 11)], max_tokens=10)
    first = run_jobs(harness.engine, [(harness.prepare(case, "turn-1"), None, None)])["turn-1"]
    assert len(towers) <= 1
    ran = len(towers)
    jobs = [(harness.prepare(case, f"turn-2-{i}"), None, None) for i in range(2)]
    later = run_jobs(harness.engine, jobs)
    assert len(towers) == ran
    _assert_matches_oracle(harness, case, first)
    for result in later.values():
        _assert_matches_oracle(harness, case, result)


def _prepared_from_ids(harness, rid: str, ids: list[int], max_tokens: int, ignore_eos: bool = False):
    import numpy as np

    from vlm_serve.engine.types import PreparedRequest

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return PreparedRequest(rid, np.array(ids, np.int32), params)


def _oracle_from_ids(harness, ids: list[int], max_tokens: int) -> list[int]:
    import itertools

    from mlx_vlm.generate import generate_step

    if harness.alone is not None:  # CUDA: the engine alone, on a cache of its own
        # Past end tokens too, as mlx-vlm's greedy steps below go on.
        return harness.alone(_prepared_from_ids(harness, "oracle", ids, max_tokens, ignore_eos=True))

    steps = generate_step(mx.array([ids]), harness.oracle_model, None, None, max_tokens=max_tokens,
                          temperature=0.0, prefill_step_size=PREFILL_STEP)
    return [token for token, _ in itertools.islice(steps, max_tokens)]


def test_prefix_cache_reuses_text_prompts_and_matches_oracle(harness):
    tokenizer = harness.ctx.processor.tokenizer
    first = tokenizer.encode(chat_prompt(harness.ctx, Case("p", LONG_TEXT)), add_special_tokens=False)
    second = first + tokenizer.encode(" And then the story went on for a while longer.", add_special_tokens=False)
    cache = harness.engine.scheduler.prefix_cache
    before = cache.reused_tokens
    run_jobs(harness.engine, [(_prepared_from_ids(harness, "turn-1", first, 6), None, None)])
    result = run_jobs(harness.engine, [(_prepared_from_ids(harness, "turn-2", second, 12), None, None)])["turn-2"]
    # The whole first prompt was reused (all but its last token where a sliding window
    # had rotated: that entry is stored one token short).
    assert cache.reused_tokens - before >= len(first) - 1
    assert result["tokens"] == _oracle_from_ids(harness, second, 12)


def test_an_identical_prompt_reuses_all_but_its_last_token(harness):
    """A retry of the same prompt hits, even past Gemma's sliding window (32 tokens in
    the fixture), and still gives the oracle's tokens."""
    tokenizer = harness.ctx.processor.tokenizer
    ids = tokenizer.encode(chat_prompt(harness.ctx, Case("r", LONG_TEXT[:400])), add_special_tokens=False)
    cache = harness.engine.scheduler.prefix_cache
    run_jobs(harness.engine, [(_prepared_from_ids(harness, "try-1", ids, 6), None, None)])
    before = cache.reused_tokens
    result = run_jobs(harness.engine, [(_prepared_from_ids(harness, "try-2", ids, 6), None, None)])["try-2"]
    assert cache.reused_tokens - before == len(ids) - 1
    assert result["tokens"] == _oracle_from_ids(harness, ids, 6)


def test_a_retried_turn_two_still_reuses_all_but_its_last_token(harness):
    """Turn 2 goes on from turn 1's cached prefix in as few passes as it can, yet keeps
    what a retry of it needs past the sliding window: the retry prefills only its last
    token and gives the oracle's tokens."""
    tokenizer = harness.ctx.processor.tokenizer
    first = tokenizer.encode(chat_prompt(harness.ctx, Case("t", LONG_TEXT[:300])), add_special_tokens=False)
    second = first + tokenizer.encode(" Go on, and tell me what came next.", add_special_tokens=False)
    cache = harness.engine.scheduler.prefix_cache
    run_jobs(harness.engine, [(_prepared_from_ids(harness, "turn-1", first, 4), None, None)])
    run_jobs(harness.engine, [(_prepared_from_ids(harness, "turn-2", second, 4), None, None)])
    before = cache.reused_tokens
    result = run_jobs(harness.engine, [(_prepared_from_ids(harness, "retry", second, 6), None, None)])["retry"]
    assert cache.reused_tokens - before == len(second) - 1
    assert result["tokens"] == _oracle_from_ids(harness, second, 6)


def test_same_tokens_with_another_image_never_reuse_the_image(harness):
    """Same text, different images: identical image-placeholder token ids must not share
    KV past the first placeholder (the text before it, which cannot see the image, may)."""
    cache = harness.engine.scheduler.prefix_cache
    family = harness.engine.scheduler.family
    cases = [Case(f"img-{i}", "Describe this picture.", [make_image(40, 60, 20 + i)], max_tokens=8) for i in range(2)]
    for case in cases:
        prepared = harness.prepare(case, case.name)
        first_image = int(np.argmax(np.isin(prepared.input_ids, list(family.image_token_ids))))
        before = cache.reused_tokens
        result = run_jobs(harness.engine, [(prepared, None, None)])[case.name]
        _assert_matches_oracle(harness, case, result)
        assert cache.reused_tokens - before <= first_image


# -- bursts: prompts that arrive together are prefilled together ----------------------


@pytest.fixture
def burst(harness):
    """The harness engine with a prefill budget that lets a burst share its passes."""
    config = harness.engine.scheduler.config
    budget, config.prefill_token_budget = config.prefill_token_budget, 64 * PREFILL_STEP
    yield harness
    config.prefill_token_budget = budget


def run_burst(h: Harness, jobs, hook=None):
    return run_held(h.engine, h.prepare(Case("hold", "Hi!", max_tokens=3), "hold"), jobs, hook)


def run_held(engine: Engine, holder, jobs, hook=None, pause: float = 0.3):
    """Run jobs that reach the worker in one turn: they are submitted once ``holder``
    (request id "hold", a few tokens) has its first token, while its decode steps hold
    the worker ``pause`` seconds each. ``hook``: a further fault hook."""
    import time

    def hold(phase, states):
        if phase == "decode" and any(s.id == "hold" for s in states):
            time.sleep(pause)
        if hook is not None:
            hook(phase, states)

    engine.scheduler.fault_hook = hold
    try:
        return run_jobs(engine, [(holder, None, None)] + [
            (prepared, start_after or ("hold", 1), cancel) for prepared, start_after, cancel in jobs
        ])
    finally:
        engine.scheduler.fault_hook = None


def _burst_cases() -> dict[str, list[Case]]:
    return {
        # Same text, same image size: the same length, every pass and tower call shared.
        "same-size": [Case(f"same-{i}", "Describe this picture.", [make_image(48, 48, 30 + i)],
                           max_tokens=8) for i in range(4)],
        "sizes": [
            Case("size-a", "Describe this picture.", [make_image(40, 60, 41)], max_tokens=8),
            Case("size-b", "Describe this picture.", [make_image(96, 48, 42)], max_tokens=8),
            Case("size-c", "Describe this picture.", [make_image(40, 60, 43)], max_tokens=8),
            Case("size-d", "Describe this picture.", [make_image(28, 90, 44)], max_tokens=8),
        ],
        # Text and images, short and long prompts (long ones share their first chunks).
        "mixed": [
            Case("mixed-img", "What colours are here?", [make_image(56, 56, 51)], max_tokens=8),
            Case("mixed-text", "Hi there!", max_tokens=8),
            Case("mixed-long-a", LONG_TEXT + " Summarise.", max_tokens=8),
            Case("mixed-long-b", LONG_TEXT[:700] + " Summarise it.", max_tokens=8),
            Case("mixed-text-b", "Hi you!", max_tokens=8),
            Case("mixed-img-b", "What colours are here?", [make_image(56, 56, 52)], max_tokens=8),
        ],
    }


@pytest.mark.parametrize("kind", ["same-size", "sizes", "mixed"])
def test_burst_prefilled_together_matches_each_alone(burst, kind):
    """Requests submitted at once share vision-tower calls and language-model passes
    where their family allows; each still gets exactly its tokens alone."""
    cases = _burst_cases()[kind]
    scheduler = burst.engine.scheduler
    rows = scheduler.shared_prefill_rows
    results = run_burst(burst, [(burst.prepare(c, c.name), None, None) for c in cases])
    for case in cases:
        _assert_matches_oracle(burst, case, results[case.name])
    family = scheduler.family
    if family.batch_prefill and (kind == "mixed" or family.batch_prefill_images):
        assert scheduler.shared_prefill_rows > rows  # passes really were shared


def test_a_burst_led_by_a_long_prompt_still_shares_the_rest(burst):
    """The first prompt of a burst needs passes of its own (it is longer); the two
    after it are alike (same length) and share theirs, and each gives the oracle's
    tokens."""
    scheduler = burst.engine.scheduler
    if not scheduler.family.batch_prefill:
        pytest.skip("this family prefills text prompts one at a time")
    tokenizer = burst.ctx.processor.tokenizer
    long = tokenizer.encode(chat_prompt(burst.ctx, Case("l", LONG_TEXT)), add_special_tokens=False)
    short = tokenizer.encode(chat_prompt(burst.ctx, Case("s", "Name a colour.")), add_special_tokens=False)
    prompts = {"lead-long": long, "alike-a": short, "alike-b": short[:-2] + short[-1:] + short[-2:-1]}
    rows = scheduler.shared_prefill_rows
    results = run_burst(burst, [(_prepared_from_ids(burst, rid, ids, 6), None, None)
                                for rid, ids in prompts.items()])
    for rid, ids in prompts.items():
        assert results[rid]["tokens"] == _oracle_from_ids(burst, ids, 6)
    assert scheduler.shared_prefill_rows >= rows + 2


def test_a_burst_from_cached_prefixes_of_different_lengths_shares_its_passes(burst):
    """Three prompts of one length find cached prefixes 2 and 4 tokens apart (an earlier
    prompt shared a little more with some of them). Each would go on alone from its own;
    they go on together from the shortest, in one shared pass, and each gives the
    oracle's tokens."""
    scheduler = burst.engine.scheduler
    if not scheduler.family.batch_prefill:
        pytest.skip("this family prefills text prompts one at a time")
    tokenizer = burst.ctx.processor.tokenizer
    stored = tokenizer.encode(chat_prompt(burst.ctx, Case("c", "Count the red birds.")), add_special_tokens=False)
    run_jobs(burst.engine, [(_prepared_from_ids(burst, "stored", stored, 2), None, None)])
    other = tokenizer.encode(" seven green frogs jumped over the old stone wall", add_special_tokens=False)
    shared = [len(stored) - 8, len(stored) - 6, len(stored) - 4]  # tokens each shares with it
    prompts = {}
    for n in shared:
        tail = [t for t in other if t != stored[n]][:len(stored) - n]  # parts from it at n
        prompts[f"from-{n}"] = stored[:n] + tail
    rows = scheduler.shared_prefill_rows
    results = run_burst(burst, [(_prepared_from_ids(burst, rid, ids, 6), None, None)
                                for rid, ids in prompts.items()])
    for rid, ids in prompts.items():
        assert results[rid]["tokens"] == _oracle_from_ids(burst, ids, 6)
        assert results[rid]["cached"] == shared[0]  # each went on from the shortest prefix
    assert scheduler.shared_prefill_rows >= rows + len(prompts)


def test_image_prompts_from_cached_text_of_different_lengths_share_their_passes(burst):
    """Image prompts whose text comes first find cached prefixes of that text a few
    tokens apart; they go on from the shortest (never past an image) and share their
    passes where their family shares image prompts', each with the oracle's tokens."""
    scheduler = burst.engine.scheduler
    family = scheduler.family
    if not (family.prefix_cache and family.image_prefix_cache and family.image_token_ids):
        pytest.skip("this family keeps no prefixes of image prompts")
    words = "seven green frogs jumped over the old stone wall".split()
    stored = Case("img-stored", " ".join(words), [make_image(48, 48, 70)], max_tokens=2, text_first=True)
    run_jobs(burst.engine, [(burst.prepare(stored, stored.name), None, None)])
    # The same words, the last ones swapped: as long, sharing 6, 5 and 4 words with it.
    cases = [Case(f"img-from-{n}", " ".join(words[:n] + words[n:][::-1]), [make_image(48, 48, 71 + n)],
                  max_tokens=6, text_first=True) for n in (6, 5, 4)]
    prepared = [burst.prepare(c, c.name) for c in cases]
    cache = scheduler.prefix_cache
    shortest = min(cache.reusable(p.input_ids.tolist()) for p in prepared)
    rows = scheduler.shared_prefill_rows
    results = run_burst(burst, [(p, None, None) for p in prepared])
    for case in cases:
        _assert_matches_oracle(burst, case, results[case.name])
        assert results[case.name]["cached"] == shortest
    if family.batch_prefill_images and family.pad_last_prefill:
        assert scheduler.shared_prefill_rows >= rows + len(cases)


def test_burst_shares_the_vision_tower_and_the_cache_still_serves(burst, monkeypatch):
    """Same-sized images of a burst run through one tower call; resent, they need no
    tower at all (the vision cache or the prefix cache serves them) and the tokens stay
    the oracle's."""
    cases = [Case(f"tower-{i}", "What is in it?", [make_image(48, 48, 60 + i)], max_tokens=8)
             for i in range(4)]  # images no earlier test sent
    scheduler = burst.engine.scheduler
    family = scheduler.family
    calls, encode = [], family.encode_images
    monkeypatch.setattr(family, "encode_images", lambda *args: calls.append(args) or encode(*args))
    towers = scheduler.shared_tower_requests
    first = run_burst(burst, [(burst.prepare(c, f"t1-{c.name}"), None, None) for c in cases])
    if family.batch_vision:  # on CUDA, in calls of the sizes checked to keep each image's bits
        sharing = family.tower_sharing
        pixels = model_arrays(burst.prepare(cases[0], "pixels"))["pixel_values"]
        sizes = sharing.sizes(pixels) if sharing is not None else (len(cases),)
        shared = sum(n for n in cut(len(cases), sizes) if n > 1)
        assert scheduler.shared_tower_requests >= towers + shared
    ran = len(calls)
    again = run_burst(burst, [(burst.prepare(c, f"t2-{c.name}"), None, None) for c in cases])
    for case in cases:
        _assert_matches_oracle(burst, case, first[f"t1-{case.name}"])
        _assert_matches_oracle(burst, case, again[f"t2-{case.name}"])
    assert len(calls) == ran


def test_burst_with_a_cancelled_and_a_failing_request(burst):
    """One request of a burst is cancelled mid-prefill and another fails in prefill:
    each ends alone with its own reason; the rest match the oracle."""
    cases = _burst_cases()["mixed"]
    scheduler = burst.engine.scheduler

    def hook(phase, states):
        ids = {s.id for s in states}
        if phase == "prefill" and "cancel-me" in ids:
            burst.engine.cancel("cancel-me")  # arrives while its prompt is in prefill
        if phase == "prefill" and "bad" in ids:
            raise RuntimeError("injected fault")

    bad = Case("bad", "Hi there!", max_tokens=8)
    victim = Case("cancel-me", LONG_TEXT + " Go on.", max_tokens=8)
    jobs = [(burst.prepare(c, c.name), None, None) for c in cases]
    jobs.insert(1, (burst.prepare(bad, "bad"), None, None))
    jobs.insert(3, (burst.prepare(victim, "cancel-me"), None, None))
    results = run_burst(burst, jobs, hook)
    assert results["bad"]["finish"] == FinishReason.ERROR and "injected fault" in results["bad"]["error"]
    assert results["cancel-me"]["finish"] == FinishReason.CANCELLED
    for case in cases:
        _assert_matches_oracle(burst, case, results[case.name])
    wait_until(lambda: scheduler.prefilling == deque() and scheduler.running == [])


def test_prompts_of_different_lengths_share_a_padded_last_pass(burst):
    """Prompts that go on from one cached prefix with last passes of different lengths
    share one pass where the family pads (each prompt's tokens first, the padding
    trimmed from its cache after), and each gives the oracle's tokens."""
    scheduler = burst.engine.scheduler
    if not scheduler.family.pad_last_prefill:
        pytest.skip("this family shares only passes of one length")
    tokenizer = burst.ctx.processor.tokenizer
    texts = {"seed": "Say one word.", "pad-a": "Name a colour.", "pad-b": "Name two bright colours.",
             "pad-c": "Which colour has the sky at noon?", "pad-long": LONG_TEXT[:90]}
    ids = {rid: tokenizer.encode(chat_prompt(burst.ctx, Case(rid, text)), add_special_tokens=False)
           for rid, text in texts.items()}
    assert len({len(v) for k, v in ids.items() if k != "seed"}) == 4  # four lengths
    # The first prompt leaves the chat template's opening in the prefix cache.
    run_burst(burst, [(_prepared_from_ids(burst, "seed", ids["seed"], 2), None, None)])
    rows, reused = scheduler.shared_prefill_rows, scheduler.prefix_cache.reused_tokens
    # A longer prompt leads the burst and goes on in passes of its own (more than a
    # prefill step of new tokens); the three after it still share their last pass.
    burst_ids = ("pad-long", "pad-a", "pad-b", "pad-c")
    results = run_burst(burst, [(_prepared_from_ids(burst, rid, ids[rid], 6), None, None)
                                for rid in burst_ids])
    for rid in burst_ids:
        assert results[rid]["tokens"] == _oracle_from_ids(burst, ids[rid], 6)
    assert scheduler.prefix_cache.reused_tokens > reused  # they went on from the prefix
    assert scheduler.shared_prefill_rows >= rows + 3  # ... in one pass of three rows


def test_prompts_arriving_steps_apart_wait_to_share_a_pass(burst):
    """With ``prefill_wait_steps``, prompts that keep arriving a decode step apart while
    another row decodes wait for one another and share a pass, none for more than the
    limit, and each still gives the oracle's tokens. A prompt waits only once prompts
    have been arriving that often: the first ones, and one that comes when nothing is
    decoding, never wait."""
    scheduler = burst.engine.scheduler
    if not scheduler.family.batch_prefill:
        pytest.skip("this family prefills text prompts one at a time")
    tokenizer = burst.ctx.processor.tokenizer
    base = tokenizer.encode(chat_prompt(burst.ctx, Case("w", "Name a bright colour.")), add_special_tokens=False)

    def swapped(k: int) -> list[int]:
        # The base with its 5th token swapped for a later one: the prompts differ early,
        # so those already served leave the same cached prefix (the chat template's
        # opening) for each of the rest, which may then share passes from its end.
        ids = list(base)
        ids[4], ids[4 + k] = ids[4 + k], ids[4]
        return ids

    prompts = {f"arrive-{k}": swapped(k) for k in range(1, 7)}  # six prompts of one length
    assert len({tuple(ids) for ids in prompts.values()}) == 6
    waits: dict[str, int] = {}

    def note_wait(phase, states):
        if phase == "prefill":
            for state in states:
                waits.setdefault(state.id, scheduler._turns - state.admitted_turn)

    limit, scheduler.config.prefill_wait_steps = 6, 6
    rows = scheduler.shared_prefill_rows
    scheduler._admissions.clear()  # arrivals of earlier tests are no rate of this one
    try:
        holder = burst.prepare(Case("hold", "Count to twenty.", max_tokens=24), "hold")
        # ignore_eos: the oracle's greedy steps do not stop at an end token either.
        jobs = [(_prepared_from_ids(burst, rid, ids, 4, ignore_eos=True), ("hold", k), None)
                for k, (rid, ids) in enumerate(prompts.items(), start=1)]
        results = run_held(burst.engine, holder, jobs, note_wait, pause=0.05)
    finally:
        scheduler.config.prefill_wait_steps = 0
    for rid, ids in prompts.items():
        assert results[rid]["tokens"] == _oracle_from_ids(burst, ids, 4)
    assert all(waits[rid] <= limit for rid in prompts) and max(waits[rid] for rid in prompts) > 0
    assert scheduler.shared_prefill_rows >= rows + 2  # at least two of them in one pass
    assert waits["hold"] == 0  # nothing was decoding when it came
    assert waits["arrive-1"] == 0  # prompts had not been arriving often yet
