"""MLX's own matmul on padded passes (``padded_matmul``, the default on CUDA).

The property it rests on (a row's bits do not follow the pass size from a checked floor
on) is a GPU's, measured by ``bench/gpu/matmul_row_floors.py``; on the CPU MLX's matmul
has it at every size. So here the padded product must give every row the plain
product's bits, and the check's search is driven by a product that adds terms in two
halves below a row count, as cuBLAS's split of a long input dimension does on a GPU
(standing in for the GPU, which is not here)."""

from __future__ import annotations

import math
import re
import tempfile

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_vlm import load

from vlm_serve.engine import cuda_matmul, padded_matmul, row_exact
from vlm_serve.engine.decode.store import slot_buckets
from vlm_serve.engine.engine import Engine
from vlm_serve.engine.families import family_for
from vlm_serve.engine.scheduler import SchedulerConfig
from vlm_serve.engine.types import SamplingParams
from vlm_serve.fixtures.build import cached_model
from vlm_serve.preprocess.media import MediaPolicy
from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat

from conftest import make_image
from oracle import EngineAlone
from test_parity import LONG_TEXT, run_jobs


@pytest.fixture(autouse=True)
def fresh_floors(monkeypatch):
    monkeypatch.setattr(padded_matmul, "_FLOORS", {})


def _layers():
    mx.random.seed(3)
    linear = nn.Linear(64, 96)
    quantized = nn.QuantizedLinear.from_linear(nn.Linear(128, 64), group_size=64, bits=4)
    return [("linear", linear, 64), ("quantized", quantized, 128), ("table", nn.Embedding(200, 64), 64)]


@pytest.mark.parametrize("rows", [1, 5, 300, 2100, 4200])  # 4,200: past the largest size, in pieces
def test_a_padded_pass_gives_each_row_the_plain_products_bits(rows):
    for name, layer, width in _layers():
        x = mx.random.normal((rows, 1, width))
        plain = layer.as_linear(x) if isinstance(layer, nn.Embedding) else layer(x)
        padded = padded_matmul.linear(x, layer, padded_matmul.floor_of(layer))
        assert padded.shape == plain.shape and padded.dtype == plain.dtype, name
        assert mx.array_equal(padded, plain).item(), name
    layer = nn.Linear(64, 32)
    layer.set_dtype(mx.bfloat16)  # float32 rows: rounded to the layer's dtype
    x = mx.random.normal((rows, 64))
    padded = padded_matmul.linear(x, layer, padded_matmul.floor_of(layer))
    assert padded.dtype == mx.float32
    assert mx.array_equal(padded, layer(x.astype(mx.bfloat16)).astype(mx.float32)).item()


@pytest.mark.parametrize("size", [64, 41])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_padding_a_pass_keeps_its_rows_and_adds_zeros(dtype, size):
    """On CUDA the engine's own kernel (elsewhere ``mx.pad``), in blocks of 256 words
    and, where the output's words are an odd multiple of 4 (41 rows of 12 in bfloat16),
    of 4."""
    x = (mx.random.normal((37, 96)) * 100).astype(dtype)
    out = padded_matmul.pad_rows(x, size)
    assert out.shape == (size, 96) and out.dtype == dtype
    assert mx.array_equal(out[:37], x).item() and not mx.any(out[37:]).item()


def test_a_decode_step_of_any_slot_bucket_from_8_rows_is_a_pass_size_of_its_own():
    """Steps run on the store's slot buckets: each that MLX's matmul was measured at (the
    multiples of 8) is a pass size, so a step of that many slots is not padded further."""
    buckets = [b for b in slot_buckets(padded_matmul.SIZES[-1]) if b % 8 == 0]
    assert buckets and all(padded_matmul.pass_size(b, 8) == b for b in buckets)


def _split_below(rows: int):
    plain = padded_matmul.product

    def product(x, module):
        if x.shape[0] >= rows:
            return plain(x, module)
        half = x.shape[1] // 2  # the input dimension in two parts, summed after
        return x[:, :half] @ module.weight[:, :half].T + x[:, half:] @ module.weight[:, half:].T

    return product


@pytest.mark.parametrize("split_below, floor", [(264, 264), (300, 304), (330, 384)])
def test_the_check_finds_the_size_from_which_rows_keep_their_bits(monkeypatch, split_below, floor):
    """The floor is the first pass size at or above the rows where the sums' order stops
    changing: every 8 rows from 264 to 312 (the down projection of the Gemma-3-4B shape
    keeps its bits from 264 on an H200), then every 64."""
    layer = nn.Linear(256, 32, bias=False)
    monkeypatch.setattr(padded_matmul, "product", _split_below(split_below))
    assert padded_matmul.check(layer) == floor
    assert padded_matmul.pass_size(3, floor) == floor and padded_matmul.pass_size(700, floor) == 704


def test_a_shape_whose_floor_would_cost_too_much_stays_on_the_kernel(monkeypatch):
    layer = nn.Linear(256, 32, bias=False)
    monkeypatch.setattr(padded_matmul, "product", _split_below(padded_matmul.MAX_FLOOR + 1))
    assert padded_matmul.check(layer) is None


def test_sizes_where_a_rows_bits_follow_its_place_in_the_pass_are_below_the_floor(monkeypatch):
    """A kernel may treat a pass's last rows apart (a partial tile); below 192 rows
    here, the last row of a pass gets other bits than the same row first."""
    layer = nn.Linear(256, 32, bias=False)
    plain = padded_matmul.product

    def last_row_apart(x, module):
        out = plain(x, module)
        if x.shape[0] >= 192:
            return out
        return mx.concatenate([out[:-1], out[-1:] * (1 + 2 ** -10)])

    monkeypatch.setattr(padded_matmul, "product", last_row_apart)
    assert padded_matmul.check(layer) == 192
    monkeypatch.setattr(padded_matmul, "product",
                        lambda x, m: mx.concatenate([plain(x, m)[:-1], plain(x, m)[-1:] * 2]))
    assert padded_matmul.check(layer) is None  # at every size: the kernel


@pytest.fixture
def padded_as_if_cuda(monkeypatch):
    """``cuda_matmul.available`` says CUDA, so that load makes its CUDA choices; the
    kernel itself cannot run here, and no layer may reach it."""
    monkeypatch.setattr(cuda_matmul, "available", lambda: True)
    monkeypatch.setattr(row_exact, "_USE_KERNEL", True)
    monkeypatch.setattr(row_exact, "_PADDED", True)
    monkeypatch.setattr(row_exact.model_attention, "route", lambda lm: [])

    def no_kernel(x, module):
        raise AssertionError("a checked shape reached the row-exact kernel")

    monkeypatch.setattr(cuda_matmul, "linear", no_kernel)


def test_every_layer_of_a_model_and_its_step_takes_the_padded_product(padded_as_if_cuda):
    model, _ = load(str(cached_model("gemma3")))
    family = family_for(model)
    assert family.batched
    decoder = family.decoder()  # its fused layers are shapes of their own, checked as it builds
    shapes = {key[0] for key in padded_matmul._FLOORS}
    qkv = decoder.layers[0].qkv.module.weight.shape
    assert tuple(qkv) in shapes and all(padded_matmul._FLOORS.values())
    layer = model.language_model.model.layers[0].self_attn.q_proj
    x = mx.random.normal((3, 7, layer.weight.shape[1]))
    assert mx.array_equal(layer(x), x @ layer.weight.T).item()


def _graph_nodes(out: mx.array) -> list[str]:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        return re.findall(r'label ="([^"]+)"', f.read())


@pytest.mark.parametrize("rows", [1, 5, 64, 2100])
def test_a_decode_steps_call_gives_the_layers_bits_with_its_choices_made_once(padded_as_if_cuda, rows):
    """``row_exact.step_call``: the layer's own bits, with ``W.T`` taken at build, so
    that a pass of a checked size is one matmul node in the step's graph (no transpose,
    no reshape, no padding) and a shorter one a pad, the matmul and a slice."""
    layers = nn.Module()
    layers.biased, layers.proj, layers.table = nn.Linear(64, 96), nn.Linear(64, 96, bias=False), nn.Embedding(200, 64)
    assert row_exact.install(layers) == []
    assert row_exact.step_call(layers.table) is layers.table  # a lookup stays a lookup
    x = mx.random.normal((rows, 64))
    for layer, tied in ((layers.biased, False), (layers.proj, False), (layers.table, True)):
        call = row_exact.step_call(layer, tied)
        own = layer.as_linear if tied else layer
        assert mx.array_equal(call(x), own(x)).item()
        assert mx.array_equal(call(x[:, None]), own(x[:, None])).item()
        if layer is layers.biased:
            continue
        mx.eval(x)
        nodes = sorted(_graph_nodes(call(x)))
        if rows in padded_matmul.SIZES:
            assert nodes == ["Matmul"]
        elif rows < padded_matmul.SIZES[-1]:
            assert nodes == ["Matmul", "Pad", "Slice"]


def test_a_quantized_shape_whose_product_strays_from_its_weights_stays_on_the_kernel(monkeypatch):
    """As MLX 0.32.4's CUDA 4-bit matmul does for narrow layers past one row."""
    _, layer, _ = _layers()[1]
    assert padded_matmul.check(layer) == padded_matmul.SIZES[0]
    plain = padded_matmul.product
    monkeypatch.setattr(padded_matmul, "product", lambda x, m: plain(x, m) * (x.shape[0] == 1))
    assert padded_matmul.check(layer) is None
    # Right up to 64 rows, and wrong (alike) from 128 on: a floor of 128 would pass the
    # bits check, so the longest pass is held to the weights too.
    monkeypatch.setattr(padded_matmul, "product", lambda x, m: plain(x, m) * (x.shape[0] < 128))
    assert padded_matmul.check(layer) is None


def test_a_product_that_changes_from_run_to_run_stays_on_the_kernel(monkeypatch):
    layer = nn.Linear(256, 32, bias=False)
    plain, largest = padded_matmul.product, []

    def drifting(x, module):  # alike across sizes, but not the largest pass run twice
        largest.extend([1] if x.shape[0] == padded_matmul.SIZES[-1] else [])
        return plain(x, module) + (len(largest) > 1) * 1e-3

    monkeypatch.setattr(padded_matmul, "product", drifting)
    assert padded_matmul.check(layer) is None


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_5_vl"])
def test_an_engine_on_padded_products_serves_each_row_as_alone(padded_as_if_cuda, monkeypatch, arch):
    """Every product of the engine takes the padded path (none reaches the kernel):
    prefill passes alone and shared, the compiled decode step with rows joining and
    leaving; and the engine serves each row its tokens alone. Here with MLX's attention
    (the engine's attention kernels are CUDA's), where padding cannot change a row's
    bits; on a GPU the parity suite runs on it (the default there)."""
    padded = []
    linear = padded_matmul.linear
    monkeypatch.setattr(padded_matmul, "linear",
                        lambda x, m, f, w=None: padded.append(x.shape) or linear(x, m, f, w))
    path = str(cached_model(arch))
    engine = Engine(path, SchedulerConfig(max_num_seqs=8, prefill_step_size=32, prefill_token_budget=64))
    engine.start()
    alone = EngineAlone(path, 32)
    try:
        loaded = engine.loaded
        ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 8, loaded.chat_template)

        def job(rid, text, images=(), max_tokens=12, after=None):
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
            prompt = render_chat(ctx, [{"role": "user", "content": parts}])
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            return prepare_prompt(ctx, rid, prompt, params, list(images)), after, None

        jobs = [job("long", LONG_TEXT[:400], max_tokens=16), job("short", "Hi!", max_tokens=20),
                job("image", "Describe this picture.", [make_image(40, 60, 1)]),
                job("late", "What colours are here?", max_tokens=8, after=("short", 5))]
        results = run_jobs(engine, jobs)
        for prepared, _, _ in jobs:
            assert results[prepared.request_id]["error"] is None
            assert results[prepared.request_id]["tokens"] == alone(prepared), prepared.request_id
        assert engine.scheduler.peak_running >= 3  # rows really shared steps
        rows = {math.prod(shape[:-1]) for shape in padded}
        assert max(rows) >= 32 and len(rows) >= 4  # prefill passes of chunks, steps of slots
    finally:
        engine.shutdown()
        alone.shutdown()


def test_the_startup_line_names_each_checked_shapes_floor_and_the_checks_time():
    layer = nn.Linear(48, 72, bias=False)
    floor = padded_matmul.floor_of(layer)
    line = padded_matmul.describe()
    assert f"72x48 mlx.core.float32: from {floor} rows" in line
    assert re.search(r"\(checked in \d+\.\d s\)$", line)
