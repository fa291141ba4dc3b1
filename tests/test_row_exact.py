"""Which layers ``row_exact`` puts on the row-exact matmul at load, and what a model
gets when one cannot take it. The kernel itself runs only on CUDA
(``tests/test_cuda_matmul.py``); here, with no GPU, ``cuda_matmul.available`` is
patched to say CUDA so that the choices made at load can be checked on the real tiny
models. Nothing here calls the kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.nn as nn
import pytest
from mlx_vlm import load

from vlm_serve.engine import cuda_matmul, model_attention, row_exact
from vlm_serve.engine.decode import attention
from vlm_serve.engine.decode.fused import StepLinear
from vlm_serve.engine.decode.ministral3 import Ministral3Decoder
from vlm_serve.engine.families import SerialFamily, family_for
from vlm_serve.fixtures.build import cached_model


@pytest.fixture
def as_if_cuda(monkeypatch):
    monkeypatch.setattr(cuda_matmul, "available", lambda: True)
    monkeypatch.setattr(row_exact, "_USE_KERNEL", True)
    monkeypatch.setattr(attention, "uses_kernels", lambda: True)
    routed = []  # the model code's attention, routed at install: undone after the test
    route = model_attention.route
    monkeypatch.setattr(model_attention, "route", lambda lm: routed.extend(route(lm)) or routed)
    yield
    model_attention.unroute(routed)


def _kinds(module: nn.Module) -> set[str]:
    return {type(m).__name__ for _, m in module.named_modules()}


def _step_linears(decoder) -> list[StepLinear]:
    """The matmuls of a decode step: its own and its layers'."""
    holders = [decoder, *decoder.layers]
    return [v for holder in holders for v in vars(holder).values() if isinstance(v, StepLinear)]


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_5_vl", "gemma4", "ministral3"])
def test_every_linear_layer_of_the_language_model_takes_the_kernel(as_if_cuda, arch):
    if arch == "ministral3":
        # Its family checks at load that its step builds, and a step fuses the layers it
        # finds: they must be on the kernel by then. They once were not, and on an H200
        # its batched rows multiplied through MLX's matmul and left their tokens alone.
        path = cached_model("mistral3", preset="tiny-ministral3")
    else:
        path = cached_model(arch)
    model, _ = load(str(path))
    family = family_for(model)
    assert family.batched
    # Images: tower calls of checked sizes where a shared call stacks whole images, else
    # a call per request.
    if family.tower_stacks_images:
        assert family.batch_vision and family.tower_sharing is not None
    else:
        assert not family.batch_vision and family.tower_sharing is None
    kinds = _kinds(model.language_model)
    assert "Linear" not in kinds and "_ExactLinear" in kinds
    assert "Linear" in _kinds(model.vision_tower)  # the tower keeps MLX's matmul
    # The model code's attention (the prefill of every family but Gemma 3) on the kernel.
    module = sys.modules[type(model.language_model).__module__]
    assert getattr(module, model_attention.NAME).routed_from is not None
    linears = _step_linears(family.decoder())
    assert len(linears) > len(model.language_model.layers)  # the head and each layer's
    assert all(linear.weight_t is None and row_exact.installed(linear.module) for linear in linears)


def test_a_layer_the_kernel_cannot_take_serves_one_row_at_a_time(as_if_cuda, model_path):
    model, _ = load(str(model_path("gemma3")))
    mlp = model.language_model.model.layers[0].mlp
    mlp.down_proj = nn.QuantizedLinear.from_linear(mlp.down_proj, group_size=32, bits=3)
    family = family_for(model)
    assert isinstance(family, SerialFamily) and not family.batched
    assert "model.layers.0.mlp.down_proj" in family.reason and "CUDA" in family.reason


def test_a_decode_step_not_seen_exact_on_cuda_serves_one_row_at_a_time(as_if_cuda, monkeypatch):
    """A step may say its batched rows have differed from alone on CUDA."""
    monkeypatch.setattr(Ministral3Decoder, "exact_on_cuda", False)
    model, _ = load(str(cached_model("mistral3", preset="tiny-ministral3")))
    family = family_for(model)
    assert isinstance(family, SerialFamily)
    assert "Ministral3Decoder have differed from the same rows alone" in family.describe()


def test_a_model_without_an_engine_decode_step_serves_one_row_at_a_time(as_if_cuda, model_path,
                                                                       monkeypatch):
    """The model code's batched decode attends over left-padded caches with MLX's
    attention, whose sums follow the padded length: on CUDA only the engine's own step
    batches (a mixture-of-experts Gemma 4 has none, for one)."""
    from vlm_serve.engine.families.gemma import Gemma3

    monkeypatch.setattr(Gemma3, "decoder_class", None)
    model, _ = load(str(model_path("gemma3")))
    family = family_for(model)
    assert isinstance(family, SerialFamily) and "decode step" in family.reason


@pytest.mark.skipif(row_exact.applies(), reason="here is CUDA")
def test_elsewhere_nothing_changes(model_path):
    model, _ = load(str(model_path("gemma3")))
    family = family_for(model)
    assert family.batch_vision and "_ExactLinear" not in _kinds(model)
    module = sys.modules[type(model.language_model).__module__]
    assert not hasattr(getattr(module, model_attention.NAME), "routed_from")
    linear = model.language_model.model.layers[0].self_attn.o_proj
    assert StepLinear(linear).weight_t is not None


def test_an_unknown_matmul_choice_stops_at_import():
    """A mistyped ``VLM_SERVE_MATMUL`` must not quietly fall back to some other product."""
    env = {**os.environ, "VLM_SERVE_MATMUL": "fast"}
    run = subprocess.run([sys.executable, "-c", "import vlm_serve.engine.row_exact"], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert "VLM_SERVE_MATMUL='fast': expected padded, exact or mlx" in run.stderr
