"""The startup check of MLX's quantized kernels (``engine/quantized_check.py``), on the
real 4-bit tiny Gemma 3. The failure it guards against (MLX's CUDA backend answering a
float32 model with 4-bit weights wrongly) needs a GPU; here the device is said to be
the GPU and one layer shape's kernel is made wrong, which is what the check sees there.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_vlm import load

from vlm_serve.engine import quantized_check
from vlm_serve.engine.engine import Engine
from vlm_serve.engine.scheduler import SchedulerConfig
from vlm_serve.fixtures.build import cached_model

# On a GPU the check runs for real at every load, and the 4-bit tests elsewhere skip
# where it refuses the fixture (``oracle.skip_where_refused``).
pytestmark = pytest.mark.skipif(not quantized_check.on_cpu(), reason="simulates a GPU on the CPU")


def _wrong_for(outputs: int):
    """``QuantizedLinear.__call__`` as a faulty kernel would give it for weights of
    ``outputs`` rows: the right product with its last columns zeroed."""
    right = nn.QuantizedLinear.__call__

    def call(self, x):
        y = right(self, x)
        if self.weight.shape[0] != outputs:
            return y
        return mx.concatenate([y[..., :-6], mx.zeros_like(y[..., -6:])], axis=-1)
    return call


@pytest.fixture
def as_if_gpu(monkeypatch):
    monkeypatch.setattr(quantized_check, "on_cpu", lambda: False)


def test_right_kernels_pass_on_the_models_every_shape(as_if_gpu):
    model, _ = load(str(cached_model("gemma3", bits=4)))
    quantized_check.check(model)


def test_a_wrong_kernel_is_named_with_its_layer(as_if_gpu, monkeypatch):
    model, _ = load(str(cached_model("gemma3", bits=4)))
    monkeypatch.setattr(nn.QuantizedLinear, "__call__", _wrong_for(128))  # the MLP's gate and up
    with pytest.raises(RuntimeError, match=r"mlp\.(gate|up)_proj \(QuantizedLinear, 4-bit weights in groups of 64"):
        quantized_check.check(model)


def test_a_wrong_table_lookup_is_named(as_if_gpu, monkeypatch):
    model, _ = load(str(cached_model("gemma3", bits=4)))
    right = nn.QuantizedEmbedding.__call__
    monkeypatch.setattr(nn.QuantizedEmbedding, "__call__", lambda self, ids: right(self, ids) * 2)
    with pytest.raises(RuntimeError, match=r"embed_tokens \(QuantizedEmbedding.*float32 activations, a lookup\)"):
        quantized_check.check(model)


def test_a_wrong_kernel_stops_startup_before_any_request(as_if_gpu, monkeypatch):
    monkeypatch.setattr(nn.QuantizedLinear, "__call__", _wrong_for(838))  # the output layer
    engine = Engine(str(cached_model("gemma3", bits=4)), SchedulerConfig(max_num_seqs=2), warm=False)
    with pytest.raises(RuntimeError, match="could not start serving") as failed:
        engine.start()
    assert "lm_head" in str(failed.value.__cause__)
    assert "cannot be served correctly here" in str(failed.value.__cause__)
    engine._thread.join(timeout=30)
    assert not engine._thread.is_alive()
