"""Plain-Python request and event types shared by the API, the CPU pool and the worker.

Nothing here holds an ``mx.array``: a ``PreparedRequest`` is built on a CPU thread and
only turned into MLX arrays on the worker thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop token ids are masked until this many are generated
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # llguidance grammar (JSON mode / JSON Schema)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class PreparedRequest:
    """Everything the worker needs, as numpy arrays and Python values."""

    request_id: str
    input_ids: np.ndarray  # (L,) int32
    sampling: SamplingParams
    # Processor outputs other than input ids (pixel_values, image_grid_thw, ...); a list
    # where images of different sizes cannot be stacked.
    model_inputs: dict[str, np.ndarray | list[np.ndarray]] = field(default_factory=dict)
    num_images: int = 0
    image_digests: tuple[str, ...] = ()
    deadline: float | None = None  # time.monotonic() after which the row is stopped
    # Where set, model_inputs' pixel_values are the image processor's uint8 values and
    # each (channel, value) becomes this (channels, 256) table's float on the worker
    # (``preprocess.packed_pixels``, ``engine.model_inputs``).
    pixel_table: np.ndarray | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def has_media(self) -> bool:
        return self.num_images > 0


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationEvent:
    """One update for one request, sent from the worker to the event loop.

    ``text`` is the newly decoded text (stop strings already removed). The last event
    of a request has ``finish_reason`` set; an error event also carries ``error``.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
