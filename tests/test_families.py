"""Every model family the project builds a fixture for: batched output equals mlx-vlm's
single-request output, float32 and 4-bit, and the user's words reach the prompt.

The oracle is mlx-vlm's own ``generate_step`` on a separately loaded copy of the model,
one request at a time, fed the same token ids and processor outputs as the engine (the
promise under test is batching; tokenization is shared). Families the engine serves one
row at a time (``SerialFamily``) run the same suite, so that path is proven too.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from mlx_vlm import load as vlm_load

from vlm_serve.fixtures.build import ARCHS, cached_model
from vlm_serve.engine import prefill
from vlm_serve.engine.engine import Engine
from vlm_serve.engine.families import FAMILIES
from vlm_serve.engine.scheduler import SchedulerConfig
from vlm_serve.engine.types import PreparedRequest, SamplingParams
from vlm_serve.preprocess.media import MediaPolicy
from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat, tokenize

from conftest import make_image, wait_until
from oracle import assert_each_matches_alone, engine_alone_on_cuda, mlx_vlm_greedy, skip_where_refused
from test_parity import LONG_TEXT, run_held, run_jobs

pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter:UserWarning")

PREFILL_STEP = 32
VARIANTS = [(arch, bits) for bits in (None, 4) for arch in ARCHS]
# Families whose mlx-vlm code takes one image per request.
SINGLE_IMAGE = {"paligemma", "mllama"}
# mlx-vlm's own chunked prefill is wrong for these, so the oracle prefills whole prompts.
WHOLE_PROMPT_ORACLE = {"glm4v"}
# mlx-vlm fixes phi3_v's vision tower at full CLIP-L size: minutes per image on 2 CPU
# cores. Its image requests run only with VLM_SERVE_SLOW_TESTS=1; text runs always.
SLOW_VISION = set() if os.environ.get("VLM_SERVE_SLOW_TESTS") else {"phi3_v"}
# Families whose image prompts are proven to share prefill passes in a burst (others
# with ``batch_prefill_images`` carry an argument no pass stacks, e.g. Mistral 3's
# image_sizes, and prefill image prompts alone).
SHARED_IMAGE_PASSES = {"gemma3", "gemma4", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
# Families whose last passes of different lengths share one padded pass
# (``Family.pad_last_prefill``), proven by the padded-pass burst below.
PADDED_LAST_PASSES = {"gemma3", "llava", "idefics3", "smolvlm", "internvl_chat", "mistral3"}


class FamilyHarness:
    def __init__(self, arch: str, bits: int | None, preset: str = "tiny"):
        self.arch = arch
        path = str(cached_model(arch, preset=preset, bits=bits))
        skip_where_refused(path)
        config = SchedulerConfig(max_num_seqs=8, prefill_step_size=PREFILL_STEP,
                                 prefill_token_budget=PREFILL_STEP)
        self.engine = Engine(path, config)
        self.engine.start()
        loaded = self.engine.loaded
        self.eos = loaded.eos_token_ids
        self.ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 8,
                                 loaded.chat_template)
        self.oracle_model, _ = vlm_load(path)
        self.alone = engine_alone_on_cuda(path, PREFILL_STEP)

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.alone is not None:
            self.alone.shutdown()

    def prepare(self, rid: str, text: str, images=(), max_tokens: int = 8, lead: str = ""):
        """A user turn: ``lead`` text, then the images, then ``text``."""
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        if lead:
            parts.insert(0, {"type": "text", "text": lead})
        prompt = render_chat(self.ctx, [{"role": "user", "content": parts}])
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return prepare_prompt(self.ctx, rid, prompt, params, list(images))

    def oracle(self, prepared) -> list[int]:
        if self.alone is not None:
            return self.alone(prepared)
        step = None if self.arch in WHOLE_PROMPT_ORACLE else PREFILL_STEP
        return mlx_vlm_greedy(self.oracle_model, prepared, step, self.eos)


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: f"{v[0]}-{'q4' if v[1] else 'f32'}")
def family(request):
    h = FamilyHarness(*request.param)
    yield h
    h.shutdown()


def _requests(h: FamilyHarness):
    """(prepared, start_after) pairs: three start together, the rest join mid-decode."""
    two = h.arch not in SINGLE_IMAGE
    specs = [
        ("image-a", "Describe this picture.", [make_image(60, 40, 1)], 10),
        ("text-short", "Hi!", [], 7),
        ("image-b", "What colours are here, and why?", [make_image(90, 120, 2)], 9),
        ("text-long", LONG_TEXT[:600] + " Summarise.", [], 8),
        ("image-late", "Read it.", [make_image(48, 48, 3)], 6),
    ]
    if two:
        specs.append(("two-images", "Compare them.", [make_image(56, 56, 4), make_image(40, 80, 5)], 8))
    if h.arch in SLOW_VISION:
        specs = [(rid, text, [], n) for rid, text, _, n in specs]
    out = []
    for i, (rid, text, images, n) in enumerate(specs):
        start_after = None if i < 3 else ("image-a", 2 + i)
        out.append((h.prepare(rid, text, images, n), start_after, None))
    # An image that lands in a later prefill chunk, after a long lead text.
    lead = LONG_TEXT[:240]
    images = [] if h.arch in SLOW_VISION else [make_image(64, 64, 6)]
    out.append((h.prepare("image-mid", "What follows?", images, 8, lead), None, None))
    return out


def test_mixed_batch_with_joining_rows_matches_mlx_vlm(family):
    jobs = _requests(family)
    # image-a must outlive the joins it schedules.
    jobs[0][0].sampling.max_tokens = 12
    results = run_jobs(family.engine, jobs)
    batched = family.engine.scheduler.family.batched
    peak = family.engine.scheduler.peak_running
    assert peak >= 2 if batched else peak == 1  # rows really shared decode steps (or never)
    assert_each_matches_alone(jobs, results, family.oracle, family.arch)


def test_burst_prefilled_together_matches_mlx_vlm(family):
    """Requests that arrive together (same-sized and other-sized images, short and long
    text) share prefill work where the family's flags allow; each gets mlx-vlm's tokens."""
    images = family.arch not in SLOW_VISION
    specs = [("burst-text-a", "Hi there!", []), ("burst-text-b", "Hi you!", []),
             ("burst-long", LONG_TEXT[:500] + " Summarise.", []),
             ("burst-long-b", LONG_TEXT[:300] + " Summarise.", [])]
    if images:
        specs += [(f"burst-img-{i}", "Describe this picture.", [make_image(56, 56, 70 + i)]) for i in range(3)]
        specs.append(("burst-img-other", "Describe this picture.", [make_image(40, 80, 74)]))
    jobs = [(family.prepare(rid, text, imgs, 6), None, None) for rid, text, imgs in specs]
    scheduler = family.engine.scheduler
    rows = scheduler.shared_prefill_rows
    _burst_matches_alone(family, jobs)
    if scheduler.family.batch_prefill:
        assert scheduler.shared_prefill_rows > rows  # the text prompts shared passes


def _burst_matches_alone(family: FamilyHarness, jobs) -> None:
    """``jobs`` start in one scheduler turn, with a prefill budget that lets them all
    share; each request gets mlx-vlm's tokens alone."""
    scheduler = family.engine.scheduler
    budget, scheduler.config.prefill_token_budget = scheduler.config.prefill_token_budget, 64 * PREFILL_STEP
    try:
        results = run_held(family.engine, family.prepare("hold", "Hi!", max_tokens=3), jobs)
    finally:
        scheduler.config.prefill_token_budget = budget
    assert_each_matches_alone(jobs, results, family.oracle, family.arch)


def _image_bursts(h: FamilyHarness) -> dict[str, list]:
    """Bursts of image prompts only: (request id, lead text, text, images)."""
    picture = "Describe this picture."
    lead = LONG_TEXT[:240]  # the image lands in a later prefill chunk
    return {
        # One image size at one place: every pass (and tower call) the same.
        "same-place": [(f"place-{i}", "", picture, [make_image(56, 56, 80 + i)]) for i in range(3)],
        # Prompts of one length with the image at different places (nothing else
        # shares with either: what is shared, they share).
        "other-place": [("before", picture, "Now.", [make_image(56, 56, 84)]),
                        ("after", "Now.", picture, [make_image(56, 56, 85)])],
        # Images of different sizes (two of one size), one after a long lead text.
        "sizes": [("size-a", "", picture, [make_image(56, 56, 87)]),
                  ("size-other", "", picture, [make_image(40, 80, 88)]),
                  ("size-b", "", picture, [make_image(56, 56, 89)]),
                  ("mid-a", lead, "What follows?", [make_image(64, 64, 90)]),
                  ("mid-b", lead, "What follows?", [make_image(64, 64, 91)])],
    }


@pytest.mark.parametrize("kind", ["same-place", "other-place", "sizes"])
def test_image_burst_shares_passes_and_matches_mlx_vlm(family, kind):
    """Image prompts that arrive together share language-model passes (and, where the
    family allows, tower calls) when their family batches image prefill; each request
    still gets exactly mlx-vlm's tokens alone."""
    scheduler = family.engine.scheduler
    if family.arch in SLOW_VISION or not scheduler.family.batch_prefill_images:
        pytest.skip("image prompts of this family are prefilled one at a time")
    jobs = [(family.prepare(rid, text, images, 6, lead), None, None)
            for rid, lead, text, images in _image_bursts(family)[kind]]
    rows, towers = scheduler.shared_prefill_rows, scheduler.shared_tower_requests
    _burst_matches_alone(family, jobs)
    if family.arch in SHARED_IMAGE_PASSES:
        assert scheduler.shared_prefill_rows > rows  # image prompts really shared passes
    if scheduler.family.batch_vision:
        assert scheduler.shared_tower_requests > towers  # ... and tower calls


def test_prompts_of_different_lengths_share_a_padded_last_pass(family):
    """Prompts that go on from one cached prompt with different numbers of new tokens
    (within twice each other) share one last pass where the family pads it (each
    prompt's tokens first, the padding trimmed from its cache after); each gets mlx-vlm's
    tokens alone. Raw token ids, no chat template: the prompts end inside the fixtures'
    sliding windows (24 tokens for Ministral 3, 32 for Gemma 3), where padding is allowed."""
    from vlm_serve.engine.types import PreparedRequest

    scheduler = family.engine.scheduler
    if family.arch not in PADDED_LAST_PASSES:
        assert not scheduler.family.pad_last_prefill  # on only where this test proves it
        pytest.skip("this family shares only last passes of one length")
    tokenizer = getattr(family.ctx.processor, "tokenizer", family.ctx.processor)
    seed = tokenizer.encode("Hi!")

    def prepared(rid: str, ids: list[int], max_tokens: int) -> PreparedRequest:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return PreparedRequest(rid, np.array(ids, np.int32), params)

    # The seed leaves its KV in the prefix cache; the burst goes on from its end.
    run_jobs(family.engine, [(prepared("pad-seed", seed, 2), None, None)])
    tails = {"pad-a": " Tell me more.", "pad-b": " Name a colour.", "pad-c": " Go on, and say more."}
    prompts = {rid: seed + tokenizer.encode(t, add_special_tokens=False) for rid, t in tails.items()}
    new = sorted(len(ids) - len(seed) for ids in prompts.values())
    assert len(set(new)) == 3 and 2 * new[0] >= new[-1]  # three lengths, within twice
    jobs = [(prepared(rid, ids, 6), None, None) for rid, ids in prompts.items()]
    rows, reused = scheduler.shared_prefill_rows, scheduler.prefix_cache.reused_tokens
    _burst_matches_alone(family, jobs)
    assert scheduler.prefix_cache.reused_tokens - reused >= 3 * len(seed)  # from the seed
    assert scheduler.shared_prefill_rows >= rows + 3  # ... in one padded pass of three rows


def test_bucketed_last_passes_pad_to_a_coarse_length(family, monkeypatch):
    """Where last passes are bucketed (the default on a GPU), a prompt going on from a
    cached one runs its last pass padded to a coarse length, alone and in a burst of
    three lengths (each prompt's tokens first, the padding trimmed from its cache
    after); each gets mlx-vlm's tokens alone. Only families whose own decoder runs the
    pass (Gemma 3); the rest run their passes at their lengths."""
    from vlm_serve.engine import prefill, prefill_batch
    from vlm_serve.engine.types import PreparedRequest

    scheduler = family.engine.scheduler
    if not (scheduler.family.pad_last_prefill and scheduler.family.prefill_decoder({})):
        pytest.skip("this family's last passes run at their own length")
    monkeypatch.setattr(scheduler.config, "bucket_last_passes", True)
    passes = []  # (tokens, rows' last positions) of each last pass

    def spy(original):
        def run(model, fam, ids, embeds, cache, kwargs, n_to_process=None, last_positions=None):
            if n_to_process is None:
                ends = None if last_positions is None else last_positions.tolist()
                passes.append((embeds.shape[1], ends))
            return original(model, fam, ids, embeds, cache, kwargs, n_to_process, last_positions)
        return run

    monkeypatch.setattr(prefill, "prefill_pass", spy(prefill.prefill_pass))
    monkeypatch.setattr(prefill_batch, "prefill_pass", spy(prefill_batch.prefill_pass))
    tokenizer = getattr(family.ctx.processor, "tokenizer", family.ctx.processor)
    seed = tokenizer.encode("Pad me!")  # a prefix no other test caches

    def prepared(rid: str, tail: str, max_tokens: int) -> PreparedRequest:
        ids = seed + tokenizer.encode(tail, add_special_tokens=False) if tail else seed
        return PreparedRequest(rid, np.array(ids, np.int32), SamplingParams(max_tokens=max_tokens, temperature=0.0))

    run_jobs(family.engine, [(prepared("bucket-seed", "", 2), None, None)])
    alone = prepared("bucket-alone", " Pad this one, then.", 6)
    expected = family.oracle(alone)  # before the spy listens: on CUDA the oracle is an engine too
    passes.clear()
    reused = scheduler.prefix_cache.reused_tokens
    assert run_jobs(family.engine, [(alone, None, None)])["bucket-alone"]["tokens"] == expected
    new = len(alone.input_ids) - (scheduler.prefix_cache.reused_tokens - reused)
    assert 1 < new < prefill.PASS_STEP
    assert passes == [(prefill.PASS_STEP, [new - 1])]  # padded, its logits from its own end

    tails = {"bucket-a": " Buckets one.", "bucket-b": " Buckets two.", "bucket-c": " Buckets three, longer."}
    jobs = [(prepared(rid, tail, 6), None, None) for rid, tail in tails.items()]
    passes.clear()
    _burst_matches_alone(family, jobs)
    # One padded pass of three rows, each taking its logits at its own end.
    assert any(n == prefill.PASS_STEP and len(e or []) == 3 and min(e) < max(e) for n, e in passes), passes


def test_text_prompt_extending_a_cached_one_matches_mlx_vlm(family):
    """Turn 2 of a text chat starts from turn 1's cached prefix where the family allows."""
    first = family.prepare("turn-1", LONG_TEXT[:300], max_tokens=4)
    run_jobs(family.engine, [(first, None, None)])
    second = family.prepare("turn-2", LONG_TEXT[:300], max_tokens=8)
    tokenizer = getattr(family.ctx.processor, "tokenizer", family.ctx.processor)
    extra = tokenizer.encode(" And then the story went on.", add_special_tokens=False)
    second.input_ids = np.concatenate([first.input_ids, np.array(extra, np.int32)])
    cache = family.engine.scheduler.prefix_cache
    before = cache.reused_tokens if cache else 0
    result = run_jobs(family.engine, [(second, None, None)])["turn-2"]
    assert result["tokens"] == family.oracle(second)
    if family.engine.scheduler.family.prefix_cache:
        assert cache.reused_tokens - before >= len(first.input_ids) - 1
    else:
        assert cache is None


def test_a_chats_next_turn_goes_on_from_the_answers_kv(family):
    """A finished row leaves its prompt and its answer in the prefix cache: the next turn,
    which resends both (here as the very tokens generated) and adds a question,
    prefills only what it adds, and still gives mlx-vlm's tokens for the whole prompt."""
    # Mllama's cross-attention mask runs along the tokens: its turn 2 could not be the
    # very tokens generated without its processor, so it chats in text here.
    images = [] if family.arch in SLOW_VISION | {"mllama"} else [make_image(56, 40, 23)]
    first = family.prepare("answer-1", "Tell me a story.", images, max_tokens=12)
    answer = run_jobs(family.engine, [(first, None, None)])["answer-1"]["tokens"]
    assert answer and answer[-1] not in family.eos  # a whole answer, cut by max_tokens
    tokenizer = getattr(family.ctx.processor, "tokenizer", family.ctx.processor)
    extra = tokenizer.encode(" And then what happened?", add_special_tokens=False)
    second = family.prepare("answer-2", "Tell me a story.", images, max_tokens=8)
    second.input_ids = np.concatenate([first.input_ids, np.array(answer + extra, np.int32)])
    if "attention_mask" in second.model_inputs:
        second.model_inputs["attention_mask"] = np.ones((1, len(second.input_ids)), np.int32)
    scheduler = family.engine.scheduler
    cache = scheduler.prefix_cache
    before = cache.reused_tokens if cache else 0
    result = run_jobs(family.engine, [(second, None, None)])["answer-2"]
    assert result["tokens"] == family.oracle(second)
    if prefill.prefix_cacheable(scheduler.family, second):
        # Every token of the answer was fed back while decoding: all are in the cache.
        assert cache.reused_tokens - before == len(first.input_ids) + len(answer)


def test_image_chat_turn_two_reuses_its_prefix_and_matches_mlx_vlm(family):
    """Turn 2 of an image chat (same image, the answer and a new question) starts from
    turn 1's cache (where the family embeds the text after cached images alone, without
    even looking its images up); the same conversation with another image reuses at
    most the text before the image."""
    if family.arch in SLOW_VISION:
        pytest.skip("image requests of this family run only with VLM_SERVE_SLOW_TESTS=1")
    question = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]
    first = family.prepare("img-turn-1", "What is in the picture?", [make_image(64, 48, 21)], 4)
    run_jobs(family.engine, [(first, None, None)])
    scheduler = family.engine.scheduler
    cache, image_tokens = scheduler.prefix_cache, scheduler.family.image_token_ids
    reuses_images = cache is not None and scheduler.family.image_prefix_cache and image_tokens
    before_image = int(np.argmax(np.isin(first.input_ids, list(image_tokens)))) if image_tokens else 0
    conversation = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "Tell me more about it."},
    ]
    prompt = render_chat(family.ctx, conversation)
    for rid, seed in (("img-turn-2", 21), ("img-other", 22)):
        params = SamplingParams(max_tokens=8, temperature=0.0)
        second = prepare_prompt(family.ctx, rid, prompt, params, [make_image(64, 48, seed)])
        before = cache.reused_tokens if cache else 0
        vision = scheduler.family.vision_cache
        lookups = vision.hits + vision.misses
        result = run_jobs(family.engine, [(second, None, None)])[rid]
        assert result["tokens"] == family.oracle(second), rid
        reused = (cache.reused_tokens if cache else 0) - before
        if rid == "img-turn-2" and reuses_images:
            assert reused > before_image  # past the image: its KV came from turn 1
            if scheduler.family.text_after_cached_images:
                assert vision.hits + vision.misses == lookups  # no features needed
        else:
            assert reused <= before_image  # never past the first image placeholder


@pytest.mark.parametrize("arch", ARCHS)
def test_users_words_reach_the_prompt(arch):
    """String or list content, with or without an image: the text is in the token ids."""
    from vlm_serve.engine.loader import resolve_chat_template

    path = cached_model(arch)
    _, processor = vlm_load(str(path))
    ctx = PromptContext(processor, arch, MediaPolicy(), 4, resolve_chat_template(path, processor))
    tokenizer = getattr(processor, "tokenizer", processor)
    words = "purple elephants juggle seven lanterns"
    for content, images in [
        (words, []),
        ([{"type": "text", "text": words}], []),
        ([{"type": "image"}, {"type": "text", "text": words}], [make_image(56, 56, 9)]),
    ]:
        prompt = render_chat(ctx, [{"role": "user", "content": content}])
        ids, _ = tokenize(ctx, prompt, images)
        text_ids = [i for i in ids.tolist() if i >= 0]  # phi3_v marks images with -n
        assert words in tokenizer.decode(text_ids), (arch, content)


def test_every_fixture_family_is_batched_or_says_why():
    """The registry covers what the README's table claims; the rest run one at a time."""
    from vlm_serve.engine.families import SerialFamily, family_for

    class Probe:
        def __init__(self, model_type):
            self.config = type("Config", (), {"model_type": model_type})()

    unknown = family_for(Probe("brand_new_vlm"))
    assert isinstance(unknown, SerialFamily) and "brand_new_vlm" in unknown.describe()
    for arch, cls in FAMILIES.items():
        assert not issubclass(cls, SerialFamily) or cls(Probe(arch)).reason, arch


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_over_http_with_the_openai_client(arch, start_server):
    """A system prompt, an image turn, then a text-only turn, as a chat client sends
    them: answered, streamed the same as not, the user's words counted in the prompt."""
    from conftest import data_url

    server = start_server(arch)
    try:
        client = server.client()
        image = {"type": "image_url", "image_url": {"url": data_url(make_image(56, 84, 3))}}
        short = [{"role": "user", "content": "Hi."}]
        longer = [{"role": "user", "content": "Hi. " + " ".join(["Tell me about the lanterns."] * 6)}]
        counts = [client.chat.completions.create(model=f"tiny-{arch}", messages=m, max_tokens=1).usage.prompt_tokens
                  for m in (short, longer)]
        assert counts[1] > counts[0] + 20  # the words are in the prompt
        # Llama 3.2 Vision's own template refuses a system prompt beside an image.
        system = [] if arch == "mllama" else [{"role": "system", "content": "You are terse."}]
        first = [{"type": "text", "text": "What is here?"}] + ([] if arch in SLOW_VISION else [image])
        messages = system + [
            {"role": "user", "content": first},
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": "And what colour is it?"},
        ]
        whole = client.chat.completions.create(model=f"tiny-{arch}", messages=messages, max_tokens=6, temperature=0)
        stream = client.chat.completions.create(model=f"tiny-{arch}", messages=messages, max_tokens=6,
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
        assert whole.usage.completion_tokens >= 1
        if arch in SINGLE_IMAGE:
            import openai

            two = [{"role": "user", "content": [{"type": "text", "text": "Compare."}, image, image]}]
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=f"tiny-{arch}", messages=two, max_tokens=4)
            assert "at most 1" in refused.value.body["message"]
    finally:
        server.stop()


def _serves_a_chat(engine, grammar: str | None = None) -> None:
    ctx = PromptContext(engine.loaded.processor, engine.loaded.model_type, MediaPolicy(), 1,
                        engine.loaded.chat_template)
    prompt = render_chat(ctx, [{"role": "user", "content": "Hi!"}])
    sampling = SamplingParams(max_tokens=3, temperature=0.0, grammar=grammar)
    prepared = prepare_prompt(ctx, "after", prompt, sampling)
    assert run_jobs(engine, [(prepared, None, None)])["after"]["error"] is None


def test_warm_up_runs_text_and_image_before_ready(caplog, monkeypatch):
    """--warmup: text, image, sampled and prefix-reusing requests run once at startup,
    then a batch of every slot bucket up to --max-num-seqs, short rows and rows past
    each of the store's column steps up to 1024, and the engine serves normally after:
    a burst of prompts of an image chat's length traces no new decode step. Its turns
    are not counted or logged as slow turns (here every turn is slow), nor are idle
    turns after it; the requests served after it are."""
    import logging

    from vlm_serve.engine import scheduler
    from vlm_serve.engine.scheduler import SchedulerConfig as Config

    monkeypatch.setattr(scheduler, "SLOW_TURN_S", 0.0)
    monkeypatch.setattr(scheduler, "SLOW_TURN_LOG_S", 0.0)
    caplog.set_level(logging.INFO, logger="vlm_serve.engine")
    # A minimum reuse longer than the warm-up's prompts (as on a GPU): they hit all the same.
    engine = Engine(str(cached_model("qwen2_5_vl")), Config(max_num_seqs=12, prefix_min_reuse=1000), warm=True)
    engine.start()
    try:
        # 3 rows fill the 4-slot bucket and the continued prompt the 1-slot one.
        assert any(re.search(r"warm-up: 5 request\(s\) \(one of \d+ tokens\), then batches of 2, 8, 12 rows "
                             r"and of 1, 2, 4, 8, 12 rows of \d+, \d+ and \d+ tokens, in", r.getMessage())
                   for r in caplog.records)
        # Every slot bucket's step, for each of the store's column steps up to 1024.
        decoder = engine.scheduler.batch.decoder
        assert {(slots, columns) for slots in (1, 2, 4, 8, 12) for columns in ((512,), (768,), (1024,))} <= set(
            decoder.traced_shapes)
        assert engine.scheduler.running == [] and engine.scheduler.peak_running == 12
        assert engine.scheduler.prefix_cache.reused_tokens > 0  # the continued prompt hit
        assert engine.scheduler.prefix_cache.min_reuse == 1000  # and serving keeps the minimum
        time.sleep(1.5)  # an idle turn or two (each waits up to 1 s for requests)
        assert engine.scheduler.slow_turns == 0
        # Only this engine's worker: other tests' engines may still run in the background.
        worker = engine._thread.ident
        assert not any(r.getMessage().startswith("slow turn:") and r.thread == worker for r in caplog.records)
        _serves_a_chat(engine)
        assert engine.scheduler.slow_turns > 0
        traced = decoder.traces
        # 300 tokens: past the first column step, as the warm-up's rows (298 here). On
        # the CPU the step's mask also follows the attended span (in steps of 32
        # columns here), so the prompts stay within the warm-up rows' span.
        params = SamplingParams(max_tokens=4, temperature=0.0)
        burst = [(PreparedRequest(f"burst-{i}", np.arange(5 + i, 305 + i, dtype=np.int32) % 500 + 3, params),
                  None, None) for i in range(12)]
        assert all(r["error"] is None for r in run_jobs(engine, burst).values())
        assert decoder.traces == traced, "a burst of 300-token prompts met a step shape the warm-up had not"
    finally:
        engine.shutdown()


def test_warm_up_runs_each_padded_pass_length_where_passes_are_padded(caplog, monkeypatch):
    """With last passes padded to coarse lengths (as on a GPU), the warm-up runs one pass
    of each length up to WARM_PASS_TOKENS from a cached prefix, so no chat turn pays a
    length's first pass; the engine serves normally after."""
    import logging

    from vlm_serve.engine import warmup

    caplog.set_level(logging.INFO, logger="vlm_serve.engine")
    monkeypatch.setattr(warmup, "WARM_PASS_TOKENS", 64)
    new_tokens = {}  # warm-up pass -> prompt tokens it prefilled past the cached prefix

    def finish(self, *args, original=prefill.Prefill.finish):
        new_tokens[self.request.request_id] = self.request.num_prompt_tokens - self.reused
        return original(self, *args)

    monkeypatch.setattr(prefill.Prefill, "finish", finish)
    engine = Engine(str(cached_model("gemma3")), SchedulerConfig(max_num_seqs=2, bucket_last_passes=True),
                    warm=True)
    engine.start()
    try:
        assert any("padded passes of 16-64 tokens (4)" in r.getMessage() for r in caplog.records)
        passes = {rid: n for rid, n in new_tokens.items() if rid.startswith("warm-up-pass-")}
        assert passes == {f"warm-up-pass-{n}": n for n in (16, 32, 48, 64)}
        _serves_a_chat(engine)
    finally:
        engine.shutdown()


# Float32 and bfloat16 weights: on CUDA the tiny float32 fixtures take the float32 matmul
# and the per-query attention, bfloat16 ones the tensor-core matmul and prefill attention
# that real checkpoints take. Gemma 3 prefills through the engine, the others through
# mlx-vlm's code (on CUDA with its attention routed to the engine's kernels).
SHARED_PASS_MODELS = [("gemma3", None), ("gemma3", "bfloat16"), ("qwen2_5_vl", "bfloat16"),
                      ("gemma4", "bfloat16")]


@pytest.mark.parametrize("arch,dtype", SHARED_PASS_MODELS)
def test_long_prompts_in_shared_passes_get_their_tokens_alone(arch, dtype):
    """Prompts of a few hundred tokens and short ones, with and without an image (Gemma
    4's image tokens see each other both ways), submitted together while another row
    decodes (shared and padded passes), each get the tokens of an engine that serves
    one request at a time."""
    from oracle import EngineAlone

    path = str(cached_model(arch, dtype=dtype))
    engine, alone = Engine(path, SchedulerConfig(max_num_seqs=8)), EngineAlone(path, 512)
    engine.start()
    try:
        loaded = engine.loaded
        ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 8, loaded.chat_template)

        def prepare(rid: str, text: str, images=(), max_tokens: int = 12):
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
            prompt = render_chat(ctx, [{"role": "user", "content": content}])
            return prepare_prompt(ctx, rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                  list(images))

        texts = [LONG_TEXT, LONG_TEXT[:700], LONG_TEXT + LONG_TEXT[:500], LONG_TEXT[:300], "Tell me about the sea."]
        jobs = [(prepare(f"long-{i}", text), None, None) for i, text in enumerate(texts)]
        jobs += [(prepare("image", "Describe this picture.", [make_image(60, 40, 1)]), None, None),
                 (prepare("image-long", LONG_TEXT[:400], [make_image(48, 64, 2)]), None, None)]
        assert max(len(p.input_ids) for p, _, _ in jobs) > 300
        results = run_held(engine, prepare("hold", "Hi!", max_tokens=3), jobs)
        for prepared, _, _ in jobs:
            got = results[prepared.request_id]
            assert got["error"] is None and got["tokens"] == alone(prepared), prepared.request_id
    finally:
        engine.shutdown()
        alone.shutdown()


def test_a_failing_warm_up_request_stops_startup_with_its_error(monkeypatch):
    """A warm-up request that ends in an error (on a GPU: a kernel MLX cannot compile on
    that machine) stops startup, naming the request and the error, rather than leaving a
    server up that fails every request on that path. The vision tower is made to raise
    MLX's compile error here: that failure needs a CUDA install, which this machine has
    not."""
    from mlx_vlm.models.gemma3.vision import VisionModel

    def cannot_compile(self, *args, **kwargs):
        raise RuntimeError('Failed to compile kernel: mma.h(55): cannot open source file "crt/mma.h"')

    monkeypatch.setattr(VisionModel, "__call__", cannot_compile)
    engine = Engine(str(cached_model("gemma3")), SchedulerConfig(max_num_seqs=2), warm=True)
    with pytest.raises(RuntimeError) as failed:
        engine.start()
    message = str(failed.value.__cause__)
    assert message.startswith("warm-up failed (--no-warmup starts without it): warm-up-image: prefill failed")
    assert "crt/mma.h" in message
    engine._thread.join(timeout=30)
    assert not engine._thread.is_alive()


def _served_in_order(method: str, grammar: str | None = None, until=None) -> list[tuple[str, object]]:
    """Serve one chat (request "after") on a fresh engine and return, in order, what its
    scheduler handed the event loop (``("token", id)``, ``("finished", id)``) and its
    calls of ``method`` (with the ids of the rows it was called for, or of the running
    rows); ``until(order)`` is waited for before the engine stops."""
    engine = Engine(str(cached_model("gemma3")), SchedulerConfig(max_num_seqs=2))
    engine.start()
    order = []
    scheduler = engine.scheduler
    publish, original = scheduler.publish, getattr(scheduler, method)

    def published(events):
        for e in events:
            order.extend([("token", e.request_id)] * bool(e.token_ids) + [("finished", e.request_id)] * e.finished)
        publish(events)

    def called(*args):
        order.append((method, [s.id for s in (args[0] if args else scheduler.running)]))
        return original(*args)

    scheduler.publish = published
    setattr(scheduler, method, called)
    try:
        _serves_a_chat(engine, grammar)
        if until is not None:
            wait_until(lambda: until(order))
    finally:
        engine.shutdown()
    return order


@pytest.mark.parametrize("grammar", [False, True], ids=["free", "json"])
def test_a_lone_rows_first_token_is_published_before_its_next_step_is_built(grammar):
    """A row that joins an idle batch has its first token handed to the event loop
    before the batch's next step is built and launched (host work of several ms on a
    GPU that would otherwise sit in every such request's time to first token); under a
    grammar, whose tokens are all read back before the next step, too."""
    from vlm_serve.engine.grammar import json_grammar

    order = _served_in_order("_launch", json_grammar({"type": "json_object"}) if grammar else None)
    first = order.index(("token", "after"))
    launches = [i for i, (kind, _) in enumerate(order) if kind == "_launch"]
    assert launches and first < launches[0], order


def test_a_finished_rows_last_event_is_published_before_its_answer_is_kept():
    """A row that finishes has its last event (its finish reason) handed to the event
    loop before its prompt and answer are copied out of the batch for the prefix cache:
    host work for every layer of every row that finished in the step, which the end of
    an answer need not wait for."""
    kept = ("_keep_answers", ["after"])
    order = _served_in_order("_keep_answers", until=lambda order: kept in order)
    assert order.index(("finished", "after")) < order.index(kept), order
