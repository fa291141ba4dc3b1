"""What the parity tests compare with: mlx-vlm's own greedy generation of one prepared
request alone, and one prompt prefilled alone by the engine. On CUDA, where the engine
computes with kernels of its own (attention, the row-exact matmul) that round otherwise
than mlx-vlm's, the oracle is the engine itself serving each request alone
(``EngineAlone``): the promise there is batched against alone on the same engine."""

from __future__ import annotations

import dataclasses
import itertools

import mlx.core as mx
import pytest
from mlx_vlm.generate import generate_step

from vlm_serve.engine import quantized_check, row_exact
from vlm_serve.engine.model_inputs import model_arrays
from vlm_serve.engine.prefill import Prefill
from vlm_serve.engine.types import PreparedRequest, SamplingParams


def mlx_vlm_greedy(model, prepared, prefill_step_size: int | None, eos=()) -> list[int]:
    """The tokens mlx-vlm's ``generate_step`` gives ``prepared`` alone (up to its
    ``max_tokens``, ending at a token of ``eos``); ``prefill_step_size`` None prefills
    the whole prompt at once."""
    arrays = model_arrays(prepared)
    pixel_values = arrays.pop("pixel_values", None)
    mask = arrays.pop("attention_mask", None)
    ids = mx.array(prepared.input_ids)[None]
    if mask is None and pixel_values is not None:
        mask = mx.ones(ids.shape, mx.int32)
    n = prepared.sampling.max_tokens
    tokens = []
    for token, _ in itertools.islice(
        generate_step(ids, model, pixel_values, mask, max_tokens=n, temperature=0.0,
                      prefill_step_size=prefill_step_size, **arrays), n,
    ):
        tokens.append(int(token))
        if tokens[-1] in eos:
            break
    return tokens


class EngineAlone:
    """A second engine on the same model that serves one request at a time."""

    def __init__(self, path: str, prefill_step: int):
        from vlm_serve.engine.engine import Engine
        from vlm_serve.engine.scheduler import SchedulerConfig

        self.engine = Engine(path, SchedulerConfig(max_num_seqs=1, prefill_step_size=prefill_step,
                                                   prefill_token_budget=prefill_step))
        self.engine.start()

    def __call__(self, prepared) -> list[int]:
        from test_parity import run_jobs

        alone = dataclasses.replace(prepared, request_id=f"alone-{prepared.request_id}")
        return run_jobs(self.engine, [(alone, None, None)])[alone.request_id]["tokens"]

    def shutdown(self) -> None:
        self.engine.shutdown()


def engine_alone_on_cuda(path: str, prefill_step: int) -> EngineAlone | None:
    """The oracle engine where the engine keeps rows exact with its own kernels (CUDA);
    None elsewhere (mlx-vlm is the oracle there)."""
    return EngineAlone(path, prefill_step) if row_exact.applies() else None


def prefilled_alone(model, family, request_id: str, ids) -> Prefill:
    """``ids`` prefilled on a cache of its own, in one chunk."""
    prefill = Prefill(model, family, PreparedRequest(request_id, ids, SamplingParams()), 4096)
    while not prefill.done:
        prefill.step()
    return prefill


def assert_each_matches_alone(jobs, results, oracle, label: str = "") -> dict[str, list[int]]:
    """Every job's request finished without error, with the tokens ``oracle`` gives it
    alone; returns those tokens by request id."""
    expected_by_id = {}
    for prepared, _, _ in jobs:
        rid = prepared.request_id
        result = results[rid]
        assert result["error"] is None, result["error"]
        expected = oracle(prepared)
        assert result["tokens"] == expected, f"{label} {rid}: batched {result['tokens']} != alone {expected}"
        expected_by_id[rid] = expected
    return expected_by_id


def skip_where_refused(path: str) -> None:
    """Skip a test of a model the engine refuses on this machine: MLX 0.32.4's CUDA
    quantized matmul gives wrong results for 4-bit layers of 64 inputs and up to 128
    outputs (the tiny fixtures' width) past one row, and the engine refuses such a
    model at load (``engine/quantized_check.py``)."""
    if quantized_check.on_cpu():
        return
    from mlx_vlm import load as vlm_load

    try:
        quantized_check.check(vlm_load(path)[0])
    except RuntimeError as refused:
        pytest.skip(f"refused on this machine: {refused}")


def skip_on_cuda_against_model_code() -> None:
    """Skip a bitwise comparison of the engine's step with mlx-vlm's model code on CUDA,
    where the step runs the engine's own kernels (attention, the row-exact matmul) and
    the model code MLX's: there the promise is batched against alone on the engine."""
    if row_exact.applies():
        pytest.skip("on CUDA the engine's step and the model code run different kernels")


class FullLengthHarness:
    """An engine on a model directory and mlx-vlm's own copy of it, for tests of a decode
    step: every row runs its full ``max_tokens`` (EOS ignored, here and in the oracle)."""

    def __init__(self, path: str, prefill_step: int):
        from mlx_vlm import load as vlm_load

        from vlm_serve.engine.engine import Engine
        from vlm_serve.engine.scheduler import SchedulerConfig
        from vlm_serve.preprocess.media import MediaPolicy
        from vlm_serve.preprocess.prompt import PromptContext

        skip_where_refused(path)
        self.prefill_step = prefill_step
        config = SchedulerConfig(max_num_seqs=8, prefill_step_size=prefill_step,
                                 prefill_token_budget=prefill_step)
        self.engine = Engine(path, config)
        self.engine.start()
        loaded = self.engine.loaded
        self.ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 8,
                                 loaded.chat_template)
        self.oracle_model, _ = vlm_load(path)
        self.alone = engine_alone_on_cuda(path, prefill_step)

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.alone is not None:
            self.alone.shutdown()

    def prepare(self, rid: str, text: str, images=(), max_tokens: int = 40, chat: bool = True):
        """``chat`` off: ``text`` is the whole prompt; on: a user turn in the chat template."""
        from vlm_serve.preprocess.prompt import prepare_prompt, render_chat

        prompt = text
        if chat:
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
            prompt = render_chat(self.ctx, [{"role": "user", "content": parts}])
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return prepare_prompt(self.ctx, rid, prompt, params, list(images))

    def oracle(self, prepared) -> list[int]:
        if self.alone is not None:
            return self.alone(prepared)
        return mlx_vlm_greedy(self.oracle_model, prepared, self.prefill_step)
