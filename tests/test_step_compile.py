"""On CUDA a decode step past ``step.CUDA_COMPILE_MAX_SLOTS`` slots runs op by op (faster
there than compiled), but only where op by op gives the compiled step's bits: a row must
decode the same tokens whatever the number of slots. Gemma 4's step rounds differently
op by op on an H200; the CPU rounds both alike, so here the limit is lowered to one slot
and, for the second case, the op-by-op forward is made to answer differently."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from vlm_serve.engine.engine import Engine
from vlm_serve.engine.scheduler import SchedulerConfig
from vlm_serve.engine.types import PreparedRequest, SamplingParams
from vlm_serve.fixtures.build import cached_model

from oracle import EngineAlone
from test_parity import run_jobs


@pytest.mark.parametrize("op_by_op_differs", [False, True])
def test_a_row_keeps_its_tokens_past_the_compile_limit(op_by_op_differs, caplog):
    path = str(cached_model("gemma4"))
    engine, alone = Engine(path, SchedulerConfig(max_num_seqs=4)), EngineAlone(path, 512)
    engine.start()
    try:
        decoder = engine.scheduler.batch.decoder
        decoder.compile_max_slots = 1
        if op_by_op_differs:  # as a GPU's rounding would, only far more
            forward = decoder.forward

            def differing(*args):
                logits, keys, values = forward(*args)
                return -logits, keys, values

            decoder.forward = differing
        prompts = [[2, 5 + i, 40 + 3 * i, 77, 9 + i] for i in range(4)]
        params = SamplingParams(max_tokens=6, temperature=0.0)
        jobs = [(PreparedRequest(f"r{i}", np.array(ids, np.int32), params), None, None)
                for i, ids in enumerate(prompts)]
        with caplog.at_level(logging.INFO, logger="vlm_serve.engine"):
            results = run_jobs(engine, jobs)
        for prepared, _, _ in jobs:
            assert results[prepared.request_id]["tokens"] == alone(prepared), prepared.request_id
        assert any("decode steps past 1 slots" in r.getMessage() for r in caplog.records)
        if op_by_op_differs:
            assert decoder.op_by_op_same_bits is False
        elif mx.default_device() == mx.cpu:  # alike there; on an H200 Gemma 4's op by op rounds otherwise
            assert decoder.op_by_op_same_bits is True
    finally:
        engine.shutdown()
        alone.shutdown()


def test_the_compiled_step_is_traced_once_per_shape():
    """``StepDecoder.traces`` counts the compiled step's traces (``bench/burst.py``
    reports them): one for a batch shape first met, none when it comes again."""
    engine = Engine(str(cached_model("gemma3")), SchedulerConfig(max_num_seqs=4))
    engine.start()
    try:
        decoder = engine.scheduler.batch.decoder
        params = SamplingParams(max_tokens=3, temperature=0.0)

        def serve(name: str, rows: int) -> None:
            jobs = [(PreparedRequest(f"{name}-{i}", np.array([2, 7 + i, 40, 9], np.int32), params), None, None)
                    for i in range(rows)]
            run_jobs(engine, jobs)

        serve("first", 1)
        traced = decoder.traces
        assert traced >= 1
        serve("again", 1)
        assert decoder.traces == traced, "the same shape again"
        serve("two", 2)
        assert decoder.traces == traced + 1, "two rows: a step of two slots"
    finally:
        engine.shutdown()
