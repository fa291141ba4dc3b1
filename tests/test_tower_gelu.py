"""The vision towers' GELU in a faster form (``engine/tower_gelu.py``): MLX's bits on
every 16-bit value wherever it sits in an array, and a real vision tower's features
unchanged."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_vlm import load

from vlm_serve.engine import tower_gelu
from vlm_serve.fixtures.build import cached_model
from vlm_serve.mlx_runtime import cuda_available

APPROXIMATIONS = ("none", "precise", "tanh", "fast")
# The one-kernel form runs on CUDA only.
KERNEL = pytest.param("kernel", marks=pytest.mark.skipif(not cuda_available(), reason="a CUDA kernel"))


def _bits(x: mx.array) -> mx.array:
    return x.view(mx.uint16)


@pytest.mark.parametrize("dtype", tower_gelu.DTYPES, ids=str)
@pytest.mark.parametrize("approx", APPROXIMATIONS)
def test_the_table_gives_mlx_bits_on_every_value(approx, dtype):
    """Every value of the type, NaNs and infinities included."""
    table = tower_gelu.checked_form("table", approx, dtype)
    assert table is not None
    values = tower_gelu.every_value(dtype)
    assert mx.array_equal(_bits(table(values)), _bits(nn.GELU(approx=approx)(values))).item()


@pytest.mark.parametrize("dtype", tower_gelu.DTYPES, ids=str)
@pytest.mark.parametrize("form", ["cube", KERNEL])
def test_the_cube_forms_give_mlx_bits_on_every_value(form, dtype):
    """The tanh approximation only: the other two have no cube. ``kernel``: the cube
    form's chain in one CUDA kernel."""
    f = tower_gelu.checked_form(form, "precise", dtype)
    assert f is not None
    values = tower_gelu.every_value(dtype)
    assert mx.array_equal(_bits(f(values)), _bits(nn.gelu_approx(values))).item()
    assert tower_gelu.checked_form(form, "none", dtype) is None


def test_the_kernel_form_is_cuda_only():
    assert (tower_gelu.checked_form("kernel", "precise", mx.bfloat16) is not None) == cuda_available()


@pytest.mark.parametrize("form", ["table", "cube", KERNEL])
def test_views_and_odd_sizes_get_mlx_bits(form):
    """An activation of a tower's width, a transposed view, a size with few factors of
    two, and a view that starts off 16-byte alignment."""
    f = tower_gelu.checked_form(form, "precise", mx.bfloat16)
    x = (mx.random.normal((3, 97, 4304), key=mx.random.key(1)) * 3).astype(mx.bfloat16)
    for view in (x, x.transpose(2, 0, 1), x.reshape(-1)[: 63 * 97], x.reshape(-1)[3:]):
        assert mx.array_equal(f(view), nn.gelu_approx(view)).item()


@pytest.mark.parametrize("form", ["table", "cube", KERNEL])
def test_a_vision_tower_gives_the_same_features_with_it(form, monkeypatch):
    """Gemma 3's tower (the tiny fixture) with and without ``install`` (wherever MLX
    runs, not only where the form is the default): in float32 (no form: MLX's op) and in
    bfloat16 (the form in each layer)."""
    monkeypatch.setattr(tower_gelu, "SETTING", form)
    plain, _ = load(str(cached_model("gemma3")))
    model, _ = load(str(cached_model("gemma3")))
    assert tower_gelu.install(model) > 0
    gelus = [m for _, m in model.vision_tower.named_modules() if isinstance(m, nn.GELU)]
    assert gelus and all(isinstance(m, tower_gelu._FasterGELU) and m._form == form for m in gelus)
    calls = []
    faster = tower_gelu._forms[(form, gelus[0]._approx, mx.bfloat16)]
    monkeypatch.setitem(tower_gelu._forms, (form, gelus[0]._approx, mx.bfloat16),
                        lambda x: calls.append(x.dtype) or faster(x))
    size = model.config.vision_config.image_size
    pixels = mx.random.normal((2, size, size, 3), key=mx.random.key(3))
    for dtype in (mx.float32, mx.bfloat16):
        plain.set_dtype(dtype)
        model.set_dtype(dtype)
        features = model.vision_tower(pixels.astype(dtype), output_hidden_states=True)[0]
        assert features.dtype == dtype
        assert set(calls) == ({dtype} if dtype != mx.float32 else set())
        assert mx.array_equal(features, plain.vision_tower(pixels.astype(dtype), output_hidden_states=True)[0]).item()


def test_where_the_kernel_form_fails_the_cube_form_serves(monkeypatch):
    """The kernel form failing to build (as with an MLX whose device headers differ,
    made to happen here on any device) leaves Gemma 3's tower on the cube form, with the
    plain tower's features."""
    def failing(x):
        raise RuntimeError("nvrtc: cannot open source file")

    def build(form, approx, dtype):
        return failing if form == "kernel" else original(form, approx, dtype)

    original = tower_gelu._build
    monkeypatch.setattr(tower_gelu, "_build", build)
    monkeypatch.setattr(tower_gelu, "_forms", {})
    monkeypatch.setattr(tower_gelu, "SETTING", "kernel")
    plain, _ = load(str(cached_model("gemma3")))
    model, _ = load(str(cached_model("gemma3")))
    assert tower_gelu.install(model) > 0
    gelus = [m for _, m in model.vision_tower.named_modules() if isinstance(m, nn.GELU)]
    assert gelus and all(m._form == "cube" for m in gelus)
    assert tower_gelu._forms[("kernel", gelus[0]._approx, mx.bfloat16)] is None
    size = model.config.vision_config.image_size
    pixels = mx.random.normal((1, size, size, 3), key=mx.random.key(4)).astype(mx.bfloat16)
    plain.set_dtype(mx.bfloat16)
    model.set_dtype(mx.bfloat16)
    assert mx.array_equal(model.vision_tower(pixels, output_hidden_states=True)[0],
                          plain.vision_tower(pixels, output_hidden_states=True)[0]).item()


def test_the_default_form_is_the_table_on_the_cpu_the_kernel_on_cuda_and_mlx_ops_on_metal(monkeypatch):
    monkeypatch.setattr(tower_gelu, "SETTING", None)
    with mx.stream(mx.cpu):
        assert tower_gelu.form_here() == "table"
    if mx.is_available(mx.gpu):
        with mx.stream(mx.gpu):
            assert tower_gelu.form_here() == ("kernel" if cuda_available() else "mlx")


def test_mlx_ops_leave_the_model_alone_and_a_wrong_setting_is_refused(monkeypatch):
    monkeypatch.setattr(tower_gelu, "SETTING", "mlx")
    model, _ = load(str(cached_model("gemma3")))
    assert tower_gelu.install(model) == 0
    assert not any(isinstance(m, tower_gelu._FasterGELU) for _, m in model.named_modules())
    monkeypatch.setattr(tower_gelu, "SETTING", "fast")
    with pytest.raises(ValueError, match="VLM_SERVE_TOWER_GELU='fast': one of table, cube, kernel, mlx"):
        tower_gelu.install(model)
