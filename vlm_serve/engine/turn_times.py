"""Where the worker's decode turns spend their host time, for the periodic stats line.

A decode step is paid on the host: building its graph, queueing its kernels
(``mx.async_eval``), waiting for the step before it to be read back, each row's
bookkeeping (detokenizing, stop checks, events), and the finished rows' leaving (their
KV copied out for the prefix cache, the store's rows moved). Summed between two stats
lines, the parts say which of them sets the pace when the device is not the limit.
Queueing and waiting give up Python's interpreter lock, so both also take in getting it
back from the event loop, which streams the tokens to the clients meanwhile.
"""

from __future__ import annotations

import time

PARTS = ("build", "queue", "wait", "rows", "leave")


class DecodeTimes:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.turns = 0
        self.rows = 0
        self.turn_s = 0.0  # whole turns with a decode step: admission and prefill too
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def add(self, part: str, since: float) -> float:
        """Count the time from ``since`` to now to ``part``; returns now."""
        now = time.perf_counter()
        self.seconds[part] += now - since
        return now

    def turn(self, seconds: float, rows: int) -> None:
        self.turns += 1
        self.rows += rows
        self.turn_s += seconds

    def describe(self) -> str:
        if not self.turns:
            return "no decode turns"
        ms = {part: 1000 * s / self.turns for part, s in self.seconds.items()}
        return (
            f"{self.turns} decode turns of {self.rows / self.turns:.0f} rows, "
            f"{1000 * self.turn_s / self.turns:.1f} ms a turn: "
            + ", ".join(f"{part} {ms[part]:.1f}" for part in PARTS)
            + f", other {1000 * self.turn_s / self.turns - sum(ms.values()):.1f} ms"
        )
