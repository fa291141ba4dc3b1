"""When a turn's prefill work goes to the device: at once, or after the turn's decode step.

On CUDA a launch blocks the host while the device's queue of launched kernels is full.
In a burst of image prompts, a turn queues a tower call and a prefill pass (~800
kernels, ~90 ms of device time on an H200 at 4 images) and then the decode step (~450
kernels): the step's launch waits for the tower. It returns with only the step's own
~10 ms left on the device, and the device then idles while the host builds the next
turn's work (``bench/results/gpu-h200-burst-phases``, section 3).

With ``DEFER`` (``VLM_SERVE_DEFER_PREFILL_LAUNCHES=1``; off until timed on a GPU), the
prefill work a turn builds (pixels, tower calls, embeddings, passes that are not a
prompt's last) is queued only after the decode step's launch. The step then meets a
queue with room, and the host blocks, if at all, while launching prefill work with the
device busy. A prompt's last pass and its first token still go at once (its time to
first token), and whatever a deferred array's result is needed for first evaluates it
anyway: deferring changes when work is queued, never what it computes.
"""

from __future__ import annotations

import os
import threading

import mlx.core as mx

DEFER = os.environ.get("VLM_SERVE_DEFER_PREFILL_LAUNCHES", "0") == "1"

# Per thread, the arrays of prefill work its turn holds back (None while launches go at
# once): each engine's worker thread does all of its MLX operations, and MLX's streams
# are the thread's own (an array queued from another thread fails).
_held = threading.local()


def held() -> list | None:
    """The prefill work this thread's turn holds back, or None."""
    return getattr(_held, "arrays", None)


def launch(arrays) -> None:
    """Queue ``arrays``' computation on the device: now, or where this thread's turn
    defers its prefill work (``defer``), once ``flush`` is called."""
    pending = held()
    if pending is None:
        mx.async_eval(arrays)
    else:
        pending.append(arrays)


def defer() -> None:
    """Hold this thread's prefill launches until ``flush`` (where ``DEFER`` is set)."""
    if DEFER and held() is None:
        _held.arrays = []


def flush() -> None:
    """Queue this thread's held prefill work, and launch at once from now on."""
    pending, _held.arrays = held(), None
    if pending:
        mx.async_eval(pending)
