"""GLM-4V decodes through the engine's own step (``decode/glm4v.py``), and batched rows
equal each row decoded alone.

A GLM-4V row's rotary position is its token count plus its ``rope_delta`` (negative
after an image: the image's tokens take fewer positions than tokens). Rows of different
lengths, with and without images, decode together here; the oracle is mlx-vlm's
``generate_step`` on a separately loaded copy of the model, one request at a time, with
whole prompts prefilled (mlx-vlm's own chunked prefill of GLM-4V is wrong). The parity
suites (``test_parity.py``, ``test_families.py``) run the fixture through the engine too.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm import load as vlm_load

from vlm_serve.engine.decode.glm4v import Glm4vDecoder
from vlm_serve.engine.types import SamplingParams
from vlm_serve.fixtures.build import cached_model
from vlm_serve.preprocess.prompt import prepare_prompt, render_chat

from conftest import make_image
from oracle import assert_each_matches_alone, prefilled_alone, skip_on_cuda_against_model_code
from test_families import FamilyHarness
from test_parity import LONG_TEXT, run_jobs


class Harness(FamilyHarness):
    """Every row runs its full length (EOS ignored, here and in the oracle)."""

    def __init__(self, bits: int | None):
        super().__init__("glm4v", bits)
        self.eos = set()

    def prepare(self, rid: str, text: str, images=(), max_tokens: int = 30, lead: str = ""):
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        if lead:
            parts.insert(0, {"type": "text", "text": lead})
        prompt = render_chat(self.ctx, [{"role": "user", "content": parts}])
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return prepare_prompt(self.ctx, rid, prompt, params, list(images))

    def rope_delta(self, prepared) -> int:
        grid = prepared.model_inputs.get("image_grid_thw")
        if grid is None:
            return 0
        ids = mx.array(prepared.input_ids)[None]
        _, delta = self.oracle_model.language_model.get_rope_index(ids, mx.array(grid))
        return int(delta.reshape(-1)[0].item())


@pytest.fixture(scope="module", params=[None, 4], ids=["f32", "q4"])
def harness(request):
    h = Harness(request.param)
    yield h
    h.shutdown()


def test_glm4v_decodes_through_its_own_step(harness):
    run_jobs(harness.engine, [(harness.prepare("probe", "Hi", max_tokens=3), None, None)])
    assert type(harness.engine.scheduler.batch.decoder) is Glm4vDecoder
    assert "engine decode step" in harness.engine.scheduler.batch.family.describe()


def test_rows_at_different_positions_and_rope_deltas_match_alone(harness):
    h = harness
    jobs = [
        (h.prepare("image-a", "Describe this picture.", [make_image(60, 40, 1)], 24), None, None),
        (h.prepare("text-short", "Hi!", max_tokens=30), None, None),
        (h.prepare("image-b", "What colours are here, and why?", [make_image(90, 120, 2)], 28),
         None, None),
        (h.prepare("text-long", LONG_TEXT[:500] + " Summarise.", max_tokens=26), None, None),
        # Joining mid-decode, at other positions than the rows already running.
        (h.prepare("two-images", "Compare them.", [make_image(56, 56, 4), make_image(40, 80, 5)],
                   22), ("image-a", 7), None),
        (h.prepare("image-mid", "What follows?", [make_image(64, 64, 6)], 20, LONG_TEXT[:240]),
         ("text-short", 11), None),
        (h.prepare("late-text", "Read it back.", max_tokens=20), ("image-b", 15), None),
    ]
    deltas = {prepared.request_id: h.rope_delta(prepared) for prepared, _, _ in jobs}
    assert deltas["text-short"] == deltas["text-long"] == 0
    assert len({d for d in deltas.values() if d}) >= 3  # images: each row its own delta
    results = run_jobs(h.engine, jobs)
    assert type(h.engine.scheduler.batch.decoder) is Glm4vDecoder
    assert h.engine.scheduler.peak_running >= 5  # the rows really shared decode steps
    assert_each_matches_alone(jobs, results, h.oracle)


@pytest.mark.parametrize("bits", [None, 4], ids=["f32", "q4"])
def test_step_logits_equal_alone_bitwise(bits):
    """Rows of different lengths and rope deltas fed the same tokens batched (the engine
    step) and each alone (the model code on its own cache, with the position ids
    mlx-vlm gives a decode step): every row's logits are equal to the bit at every step."""
    from vlm_serve.engine.batch import Batch, JoiningRow
    from vlm_serve.engine.families import family_for
    from vlm_serve.engine.sampling import BatchSampler

    skip_on_cuda_against_model_code()
    model, _ = vlm_load(str(cached_model("glm4v", bits=bits)))
    lm = model.language_model
    family = family_for(model)
    rng = np.random.default_rng(11)
    vocab = lm.args.vocab_size
    prompts = [rng.integers(20, vocab, n).astype(np.int32) for n in (70, 45, 33, 20, 9)]
    shifts = [-37, 0, -5, 12, 0]  # as images leave them (negative), and others
    steps = 24
    fed = rng.integers(20, vocab, (len(prompts), steps)).astype(np.int32)

    alone = []
    for i, ids in enumerate(prompts):
        cache = prefilled_alone(model, family, f"r{i}", ids).cache
        logits = []
        for s in range(steps):
            position = mx.full((3, 1, 1), len(ids) + s + shifts[i], mx.int32)
            out = lm(mx.array(fed[i, s:s + 1])[None], cache=cache, position_ids=position)
            logits.append(np.array(out.logits[0, -1]))
        alone.append(logits)
    batch = Batch(model, family, vocab)
    assert type(batch.decoder) is Glm4vDecoder
    for i, ids in enumerate(prompts):
        prefill = prefilled_alone(model, family, f"r{i}", ids)
        sampler = BatchSampler(vocab)
        sampler.add(SamplingParams(temperature=0.0), [])
        first = sampler.sample(prefill.logits).tokens
        state = {**prefill.row_state, "rope_delta": shifts[i]}
        batch.add([JoiningRow(prefill.cache, sampler, first, state)])
    for s in range(steps):
        batch.next_tokens = mx.array(fed[:, s])
        logits = np.array(batch._logits())
        for i in range(len(prompts)):
            assert np.array_equal(logits[i], alone[i][s]), f"row {i} step {s}"
