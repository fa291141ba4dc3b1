"""What the parity tests compare with: mlx-vlm's own greedy generation of one prepared
request alone, and one prompt prefilled alone by the engine."""

from __future__ import annotations

import itertools

import mlx.core as mx
from mlx_vlm.generate import generate_step

from vlm_serve.engine.prefill import Prefill
from vlm_serve.engine.types import PreparedRequest, SamplingParams


def mlx_vlm_greedy(model, prepared, prefill_step_size: int | None, eos=()) -> list[int]:
    """The tokens mlx-vlm's ``generate_step`` gives ``prepared`` alone (up to its
    ``max_tokens``, ending at a token of ``eos``); ``prefill_step_size`` None prefills
    the whole prompt at once."""
    arrays = {
        k: [mx.array(a) for a in v] if isinstance(v, list) else mx.array(v)
        for k, v in prepared.model_inputs.items()
    }
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


def prefilled_alone(model, family, request_id: str, ids) -> Prefill:
    """``ids`` prefilled on a cache of its own, in one chunk."""
    prefill = Prefill(model, family, PreparedRequest(request_id, ids, SamplingParams()), 4096)
    while not prefill.done:
        prefill.step()
    return prefill
