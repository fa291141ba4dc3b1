"""On CUDA, requests' images share a vision-tower call only at sizes checked to keep
each image's bits (``engine/tower_sharing.py``). The CPU keeps them at every size, so
here the check is installed by hand as on CUDA, and for the case where a size rounds
otherwise, the tower is made to answer differently from five images on, as a kernel
chosen by the batch might (no CPU kernel does)."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from vlm_serve.engine import row_exact
from vlm_serve.engine.model_inputs import model_arrays
from vlm_serve.engine.tower_sharing import SIZES, TowerSharing, cut

from conftest import make_image
from test_parity import PREFILL_STEP, Case, Harness, _assert_matches_oracle, run_burst
from test_row_exact import as_if_cuda  # noqa: F401 - a fixture


@pytest.mark.parametrize("count, sizes, calls", [
    (7, SIZES, [7]),
    (10, SIZES, [8, 2]),
    (9, SIZES, [8, 1]),
    (7, (2, 4), [4, 2, 1]),
    (3, (), [1, 1, 1]),
    (1, SIZES, [1]),
])
def test_requests_are_cut_into_calls_of_checked_sizes(count, sizes, calls):
    assert cut(count, sizes) == calls


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def harness(request, model_path):
    h = Harness(str(model_path(request.param)))
    config = h.engine.scheduler.config
    config.prefill_token_budget = 64 * PREFILL_STEP  # a burst starts in one turn
    yield h
    h.shutdown()


def _one_image_pixels(h: Harness, seed: int) -> mx.array:
    prepared = h.prepare(Case("pixels", "What is in it?", [make_image(48, 48, seed)]), "pixels")
    return model_arrays(prepared)["pixel_values"]


cpu_only = pytest.mark.skipif(row_exact.applies(), reason="on CUDA the kernels decide the sizes; "
                              "bench/gpu/tower_batch_bits.py measures them, the parity suite's bursts use them")


@cpu_only
def test_the_check_keeps_every_size_where_images_keep_their_bits(harness, caplog):
    family = harness.engine.scheduler.family
    sharing = TowerSharing(family)
    pixels = _one_image_pixels(harness, 1)
    with caplog.at_level(logging.INFO, logger="vlm_serve.engine"):
        assert sharing.sizes(pixels) == SIZES  # the CPU keeps an image's bits in any call
        assert sharing.sizes(pixels) == SIZES
    said = [r.getMessage() for r in caplog.records if "vision tower, images of shape" in r.getMessage()]
    assert said == [f"vision tower, images of shape {tuple(pixels.shape)}: calls of 2-8 images keep each "
                    "image's bits"]  # checked once per shape


@cpu_only
def test_a_burst_shares_tower_calls_only_of_the_sizes_that_kept_bits(harness, monkeypatch, caplog):
    """Six one-image requests at once, where calls of five or more images would round
    otherwise: they share calls of four and two, and each gets its tokens alone."""
    scheduler = harness.engine.scheduler
    family = scheduler.family
    encode = family.encode_images
    calls = []

    def encode_rounding_otherwise_from_five(input_ids, pixel_values, inputs):
        calls.append(pixel_values.shape[0])
        features = encode(input_ids, pixel_values, inputs)
        return features * 1.001 if pixel_values.shape[0] >= 5 else features

    monkeypatch.setattr(family, "encode_images", encode_rounding_otherwise_from_five)
    monkeypatch.setattr(family, "tower_sharing", TowerSharing(family))
    seed = int(np.random.default_rng().integers(1000, 10**6))  # images no other test sent (vision cache)
    cases = [Case(f"six-{i}", "What is in it?", [make_image(48, 48, seed + i)], max_tokens=6) for i in range(6)]
    towers = scheduler.shared_tower_requests
    with caplog.at_level(logging.INFO, logger="vlm_serve.engine"):
        results = run_burst(harness, [(harness.prepare(c, c.name), None, None) for c in cases])
    for case in cases:
        _assert_matches_oracle(harness, case, results[case.name])
    assert family.tower_sharing.checked == {next(iter(family.tower_sharing.checked)): (2, 3, 4)}
    assert scheduler.shared_tower_requests == towers + 6
    served = calls[-2:]  # after the check's calls: the burst's two shared calls
    assert served == [4, 2]
    assert any("calls of 5-8 images would round them otherwise" in r.getMessage() for r in caplog.records)


def test_warm_up_checks_the_usual_image_shape(model_path, monkeypatch, caplog):
    """Where tower calls are cut to checked sizes, the warm-up runs the check for its
    image's shape (the processor's usual one), so that no burst waits for it."""
    from vlm_serve.engine import engine as engine_module
    from vlm_serve.engine.engine import Engine
    from vlm_serve.engine.scheduler import SchedulerConfig

    def checking_family(*args, original=engine_module.family_for):
        family = original(*args)
        family.tower_sharing = TowerSharing(family)  # as on CUDA
        return family

    monkeypatch.setattr(engine_module, "family_for", checking_family)
    engine = Engine(str(model_path("gemma3")), SchedulerConfig(max_num_seqs=2), warm=True)
    with caplog.at_level(logging.INFO, logger="vlm_serve.engine"):
        engine.start()
    try:
        checked = engine.scheduler.family.tower_sharing.checked
        assert len(checked) == 1
        (shape, _), sizes = next(iter(checked.items()))
        assert shape[0] == 1  # one image's shape
        assert set(sizes) <= set(SIZES)
        if not row_exact.applies():
            assert sizes == SIZES  # the CPU keeps an image's bits in any call
        assert any(r.getMessage().startswith(f"vision tower, images of shape {shape}: ") for r in caplog.records)
    finally:
        engine.shutdown()


def test_turned_off_each_request_calls_the_tower_alone_on_cuda(as_if_cuda, monkeypatch):  # noqa: F811 - the fixture
    """VLM_SERVE_SHARE_TOWERS=0 (read at import, set here on the module): on CUDA, as
    before tower sharing, no request's images share a call."""
    from mlx_vlm import load as vlm_load

    from vlm_serve.engine import tower_sharing
    from vlm_serve.engine.families import family_for
    from vlm_serve.fixtures.build import cached_model

    monkeypatch.setattr(tower_sharing, "ENABLED", False)
    model, _ = vlm_load(str(cached_model("gemma3")))
    family = family_for(model)
    assert family.batched and not family.batch_vision and family.tower_sharing is None
