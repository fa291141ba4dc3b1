"""Timing for the preprocessing benchmarks (``image_decode.py``, ``image_processor.py``,
``image_processor_pool.py``): ways of doing one thing, timed in turn, alone or beside a
thread that runs Python, as the MLX worker does while it builds a step's graph."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable


def start_busy_thread() -> None:
    """A daemon thread that runs Python until the process ends."""
    def spin() -> None:
        n = 0
        while True:
            n += 1

    threading.Thread(target=spin, daemon=True).start()


def median_ms(ways: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each way's median wall time in ms over ``repeats`` rounds, the ways in turn in each
    round (so that a drift of the machine falls on all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            started = time.perf_counter()
            way()
            times[name].append(1000 * (time.perf_counter() - started))
    return {name: statistics.median(t) for name, t in times.items()}
