"""On the CPU, the BLAS MLX multiplies through: the bundled one is trusted (the parity
suite proves it), another one is checked at load, and a model whose rows it does not
keep exact is served one row at a time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_vlm import load

from vlm_serve.engine import cpu_blas
from vlm_serve.engine.families import family_for
from vlm_serve.fixtures.build import cached_model


@pytest.fixture(scope="module")
def gemma3():
    model, _ = load(str(cached_model("gemma3")))
    return model


def _bundled_blas() -> Path:
    libs = Path(mx.__file__).resolve().parent.parent / cpu_blas.BUNDLED
    found = sorted(libs.glob("libblas*.so*"))
    if not found:
        pytest.skip("no BLAS bundled with MLX here (not the mlx-cpu wheel on Linux)")
    return found[0]


def test_the_bundled_blas_is_trusted_and_the_model_batches(gemma3):
    assert Path(cpu_blas.blas_library()).resolve() == _bundled_blas().resolve()
    assert cpu_blas.inexact_reason(gemma3.language_model) is None
    assert family_for(gemma3).batched


def test_the_products_checked_include_the_decode_steps_fusions(gemma3):
    shapes = {shape for shape, _ in cpu_blas._product_shapes(gemma3.language_model)}
    attn = gemma3.language_model.model.layers[0].self_attn
    mlp = gemma3.language_model.model.layers[0].mlp
    qkv = sum(p.weight.shape[0] for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert (qkv, attn.q_proj.weight.shape[1]) in shapes
    assert (2 * mlp.gate_proj.weight.shape[0], mlp.gate_proj.weight.shape[1]) in shapes
    assert tuple(gemma3.language_model.model.embed_tokens.weight.shape) in shapes


def test_a_preloaded_blas_is_named_and_checked_at_load(tmp_path):
    """A copy of the bundled BLAS, preloaded from elsewhere, serves ``sgemm_`` in place
    of MLX's own: it is named, the model's products are checked, and (the reference
    BLAS keeping every row's bits) the model still batches."""
    copy = tmp_path / "libblas-preloaded.so.3"
    shutil.copy(_bundled_blas(), copy)
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from mlx_vlm import load\n"
        "from vlm_serve.engine import cpu_blas\n"
        "from vlm_serve.engine.families import family_for\n"
        f"model, _ = load({str(cached_model('gemma3'))!r})\n"
        "print('blas:', cpu_blas.blas_library())\n"
        "print('batched:', family_for(model).batched)\n"
    )
    env = {**os.environ, "LD_PRELOAD": str(copy)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert f"blas: {copy}" in out.stdout
    assert "CPU: libblas-preloaded.so.3 multiplies; checked 7 product shapes" in out.stdout
    assert "batched: True" in out.stdout


def test_a_blas_that_changes_rows_bits_serves_the_model_one_row_at_a_time(gemma3, monkeypatch, caplog):
    """Mocked: no BLAS whose rows follow the row count can be loaded into this process
    (one must be preloaded at its start, and the test machine has none). The check's
    verdict, not the library, is replaced; the family's choice is real."""
    monkeypatch.setattr(cpu_blas, "blas_library", lambda: "/opt/blas/libfastblas.so.0")
    monkeypatch.setattr(cpu_blas, "_keeps_row_bits", lambda shape, dtype: shape[0] != 256)
    reason = cpu_blas.inexact_reason(gemma3.language_model)
    assert reason == ("on the CPU, libfastblas.so.0 gives rows of 1 product shape(s) other bits "
                      "batched than alone (the first: 64 inputs to 256 outputs)")
    with caplog.at_level("WARNING", logger="vlm_serve.engine"):
        family = family_for(gemma3)
    assert not family.batched
    assert reason in family.describe()
    assert any(reason in r.getMessage() for r in caplog.records)


def test_the_check_compares_rows_batched_against_alone():
    """On the CPU's BLAS (the bundled one here) every checked row keeps its bits."""
    with mx.stream(mx.cpu):
        assert cpu_blas._keeps_row_bits((96, 64), mx.float32)
        assert cpu_blas._keeps_row_bits((1000, 48), mx.float32)
