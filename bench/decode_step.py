"""One decode step, several ways: mlx-vlm's plain forward (all rows the same length,
the model's own caches), the engine's batch through the model code on mlx-lm's batch
caches, and the engine's batch through the family's own decode step (compiled, built op
by op, and compiled with other forms of its attention for comparison). Rows are
ragged text rows of about ``--context`` tokens; times are per step, greedy, no scheduler.

    python bench/decode_step.py --model DIR --batch-sizes 1,8,32,64 --context 320
    python bench/decode_step.py --model DIR --check 8   # greedy tokens: batch vs one at a time
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import mlx.core as mx
import numpy as np
from mlx_vlm import load

sys.path.insert(0, os.path.dirname(__file__))
from step_breakdown import build_engine_batch, id_limit, plain_step, time_steps  # noqa: E402

from vlm_serve.engine.decode.attention import masked_span, mlx_attend  # noqa: E402
from vlm_serve.engine.families import family_for  # noqa: E402
from vlm_serve.engine.prefill import Prefill  # noqa: E402
from vlm_serve.engine.types import PreparedRequest, SamplingParams  # noqa: E402


def engine_step(
    model, batch: int, context: int, steps: int, use_decoder: bool, compiled: bool = True
) -> float | None:
    engine_batch = build_engine_batch(
        model, batch, context, steps + 8, ragged=True, use_decoder=use_decoder
    )
    if use_decoder and engine_batch.store is None:
        return None
    if use_decoder and not compiled:
        engine_batch.decoder.compiled = None  # build the step op by op

    def step():
        return engine_batch.step().tokens

    return time_steps(step, steps)


def served_step(model, batch: int, context: int, steps: int, read_late: int = 1, gap_ms: float = 0.0,
                busy_thread: bool = False) -> float:
    """ms a step of the engine's compiled decode step as the scheduler paces it: queue
    step N + ``read_late``, then read step N's tokens back and walk them in Python (one
    late, as ``Scheduler._decode_step``; 0: each step read back before the next is
    queued, so host and device take turns). Against ``engine`` (queued back to back,
    never read), the difference is what pacing costs.

    ``gap_ms``: the host then sleeps that long before queueing the next step, as the
    scheduler's bookkeeping holds it (the interpreter lock is free meanwhile). If a
    read-back waited only for its own step, the steps already queued keep the device
    busy through the gap; if it waited for every queued step, each gap is added to the
    step. ``busy_thread``: another thread runs Python all along (as the event loop does
    with each step's events), so the worker competes for the interpreter lock."""
    import threading
    import time
    from collections import deque

    engine_batch = build_engine_batch(model, batch, context, steps + 8, ragged=True, use_decoder=True)
    for _ in range(3):
        engine_batch.step().tokens.tolist()
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=busy, daemon=True)
    if busy_thread:
        spinner.start()
    queued, seen = deque(), 0
    started = time.perf_counter()
    for _ in range(steps):
        tokens = engine_batch.step().tokens
        mx.async_eval(tokens)
        queued.append(tokens)
        while len(queued) > read_late:
            seen += sum(1 for _ in queued.popleft().tolist())
            if gap_ms:
                time.sleep(gap_ms / 1000)
    while queued:
        seen += sum(1 for _ in queued.popleft().tolist())
    elapsed = time.perf_counter() - started
    stop.set()
    return 1000 * elapsed / steps


def check(
    model, rows: int, context: int, steps: int, use_decoder: bool = True, compiled: bool = True,
    engine_alone: bool = False,
) -> dict:
    """Greedy tokens of ``rows`` ragged rows decoded together (the engine decode step,
    or without ``use_decoder`` the model code on batch caches) and each alone: on its
    own cache through the model code, or with ``engine_alone`` as a batch of one on the
    same path (a request served alone by the engine): how many rows agree."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(10, id_limit(model), context - 13 * i).astype(np.int32) for i in range(rows)]
    decode = functools.partial(_decode_together, model, context, steps, use_decoder, compiled)
    alone = [decode([ids])[0] for ids in prompts] if engine_alone else _alone_model_code(model, prompts, steps)
    together = decode(prompts)
    agree = [a == b for a, b in zip(alone, together)]
    return {
        "rows": rows, "steps": steps, "rows_equal": sum(agree),
        "decode_path": "engine" if use_decoder and family_for(model).decoder_class else "model code",
        "compiled": compiled, "alone": "engine" if engine_alone else "model code",
        "first_difference": [
            next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            for a, b in zip(alone, together)
        ],
    }


def _decode_together(model, context, steps, use_decoder, compiled, prompts) -> list[list[int]]:
    engine_batch = build_engine_batch(
        model, len(prompts), context, steps, ragged=True, use_decoder=use_decoder, prompts=prompts
    )
    if engine_batch.store is not None and not compiled:
        engine_batch.decoder.compiled = None  # build the step op by op
    together = [[t] for t in engine_batch.next_tokens.tolist()]
    for _ in range(steps - 1):
        for row, t in zip(together, engine_batch.step().tokens.tolist()):
            row.append(t)
    return together


def _alone_model_code(model, prompts, steps) -> list[list[int]]:
    lm = model.language_model
    family = family_for(model)
    alone = []
    for i, ids in enumerate(prompts):
        prefill = Prefill(model, family, PreparedRequest(f"a{i}", ids, SamplingParams()), 4096)
        while not prefill.done:
            prefill.step()
        token = mx.argmax(prefill.logits, axis=-1)
        out = [token.item()]
        for _ in range(steps - 1):
            kwargs = family.decode_kwargs(prefill.cache, [prefill.row_state])
            logits = lm(token[:, None], cache=prefill.cache, **kwargs).logits[:, -1, :]
            token = mx.argmax(logits, axis=-1)
            out.append(token.item())
        alone.append(out)
    return alone


def grouped_attend(q, keys, values, scale, mask):
    """The engine step's earlier attention: a key/value head's query heads as the rows
    of one matmul (no broadcast of the keys), an additive mask. It rounds differently
    from MLX's own attention on CUDA (see bench/results/gpu-h100-burst)."""
    keys, values = masked_span(keys, values, mask)
    slots, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    q = (q * scale).reshape(slots, kv_heads, heads // kv_heads, dim)
    scores = mx.matmul(q, keys.swapaxes(-1, -2)) + mx.where(mask, 0.0, -mx.inf).astype(q.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return mx.matmul(weights, values).reshape(slots, heads * dim)


def per_head_attend(q, keys, values, scale, mask):
    """One query row per matmul, as MLX's own composition has it, but each query head of
    a group against its key/value head in a matmul of its own instead of broadcasting
    the keys to every query head: more matmuls, no copies of the keys."""
    keys, values = masked_span(keys, values, mask)
    slots, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    q = (q * scale).reshape(slots, kv_heads, groups, 1, dim)
    kt = keys.swapaxes(-1, -2)
    scores = mx.concatenate([mx.matmul(q[:, :, g], kt) for g in range(groups)], axis=2)
    weights = mx.softmax(mx.where(mask, scores, -mx.inf), axis=-1, precise=True)
    out = [mx.matmul(weights[:, :, g:g + 1], values) for g in range(groups)]
    return mx.concatenate(out, axis=2).reshape(slots, heads * dim)


ATTENTION_FORMS = {"mlx": mlx_attend, "grouped": grouped_attend, "per-head": per_head_attend}


def with_attention(form: str | None, run):
    """``run()`` with the engine step's attention in another form (None: its own). The
    other forms take a mask, so the decoders built meanwhile make masks."""
    from vlm_serve.engine.decode import gemma3, llama, step

    if form is None:
        return run()
    saved = gemma3.attend, llama.attend, step.uses_kernels
    gemma3.attend = llama.attend = ATTENTION_FORMS[form]
    step.uses_kernels = lambda: False
    try:
        return run()
    finally:
        gemma3.attend, llama.attend, step.uses_kernels = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--check", type=int, default=0, help="rows to check instead of timing")
    p.add_argument("--model-code", action="store_true", help="check the model-code batch path")
    p.add_argument("--eager", action="store_true", help="check the engine step built op by op")
    p.add_argument("--engine-alone", action="store_true",
                   help="check against each row alone through the same path, not the model code")
    p.add_argument("--out", default=None)
    p.add_argument("--attention", choices=sorted(ATTENTION_FORMS),
                   help="check the engine step with another attention form "
                        "(timings include each: engine_mlx_ms, engine_grouped_ms, engine_per-head_ms)")
    p.add_argument("--columns", default=None,
                   help="time only these columns, e.g. plain,engine,engine_eager (default: all)")
    args = p.parse_args()
    model, _ = load(args.model)
    if args.check:
        def run():
            return check(model, args.check, args.context, args.steps, not args.model_code,
                         not args.eager, args.engine_alone)

        result = with_attention(args.attention, run)
    else:
        result = {"device": str(mx.default_device()), "context": args.context, "steps": {}}
        for b in (int(x) for x in args.batch_sizes.split(",")):
            timings = {
                "plain": lambda: plain_step(model, b, args.context, args.steps),
                "model_code": lambda: engine_step(model, b, args.context, args.steps, False),
                "engine": lambda: engine_step(model, b, args.context, args.steps, True),
                "engine_eager": lambda: engine_step(model, b, args.context, args.steps, True, False),
                "engine_served": lambda: served_step(model, b, args.context, args.steps),
                "engine_served_2": lambda: served_step(model, b, args.context, args.steps, 2),
                "engine_taking_turns": lambda: served_step(model, b, args.context, args.steps, 0),
                "engine_served_gap": lambda: served_step(model, b, args.context, args.steps, gap_ms=2),
                "engine_served_2_gap": lambda: served_step(model, b, args.context, args.steps, 2, gap_ms=2),
                "engine_served_busy": lambda: served_step(model, b, args.context, args.steps, busy_thread=True),
                **{f"engine_{form}": functools.partial(
                    with_attention, form,
                    lambda: engine_step(model, b, args.context, args.steps, True))
                   for form in ATTENTION_FORMS},
            }
            wanted = args.columns.split(",") if args.columns else list(timings)
            row = {f"{name}_ms": timings[name]() for name in wanted}
            row = {k: round(v, 3) if v is not None else None for k, v in row.items()}
            result["steps"][b] = row
            print(b, row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if args.check:  # one line last, so a truncated log still says it
        print(f"rows equal: {result['rows_equal']} / {result['rows']}, first differing step per row: "
              f"{result['first_difference']}")


if __name__ == "__main__":
    main()
