"""The scheduler on every rank of a tensor-parallel group: rank 0 leads, the others follow.

A scheduler turn acts on its inputs (requests submitted, cancelled, past their deadline)
and then on its own state alone: which requests are admitted, how prompts are cut into
prefill chunks, which rows decode, sample and leave all follow from that state and from
the sampled tokens. Every rank samples the same tokens: the logits are equal on every
rank (each layer's partial results are summed by one all-reduce whose result every rank
receives) and every rank seeds its random state alike at the start. So rank 0 sends only
each turn's inputs, its plan, and each follower runs the same ``Scheduler`` code on them:
the same MLX ops with the same shapes, hence matching collectives, without a second copy
of the scheduling logic to keep in step.

What happens on rank 0 only: the HTTP side, and turning time into inputs (a deadline
that passed becomes a ``Remove`` in the plan). A follower publishes nothing.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from ..engine.scheduler import Scheduler, Shutdown
from ..engine.types import FinishReason


@dataclass
class Remove:
    """A request rank 0 removed on its own (its deadline passed)."""

    request_id: str
    reason: FinishReason
    error: str | None


class _Replica(Scheduler):
    """Keeps a digest of every token sampled, in order, for the heartbeat check."""

    digest = 0

    def _accept(self, state, token, logprob) -> bool:
        self.digest = zlib.crc32(f"{state.id}:{token};".encode(), self.digest)
        return super()._accept(state, token, logprob)


class LeaderScheduler(_Replica):
    """Rank 0: records the inputs of each turn and sends them before acting on them
    further, so the followers' turn starts while rank 0's runs."""

    channel = None  # control.LeaderChannel, set by Rank.attach

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._plan: list = []
        self._expiring = False

    def _take_inputs(self, idle: bool) -> None:
        self.channel.begin_turn(self.digest)
        super()._take_inputs(idle)
        # Messages handled outside a turn (warm-up's submissions) go out with this one.
        plan, self._plan = self._plan, []
        if any(isinstance(msg, Shutdown) for msg in plan):
            self.channel.closing = True  # followers now leave, which is no failure
        self.channel.broadcast(plan)

    def _handle(self, msg) -> None:
        self._plan.append(msg)
        super()._handle(msg)

    def _expire_deadlines(self) -> None:
        self._expiring = True
        try:
            super()._expire_deadlines()
        finally:
            self._expiring = False

    def _remove(self, request_id: str, reason: FinishReason, error: str | None) -> None:
        if self._expiring:
            self._plan.append(Remove(request_id, reason, error))
        super()._remove(request_id, reason, error)


class FollowerScheduler(_Replica):
    """Ranks 1..N-1: each turn takes rank 0's plan as its inputs."""

    channel = None  # control.FollowerChannel, set by Rank.attach
    timeout: float | None = None

    def _take_inputs(self, idle: bool) -> None:
        self.channel.mark = (self.channel.mark[0] + 1, self.digest)
        plan = self.channel.receive(self.timeout)
        for msg in plan:
            if isinstance(msg, Remove):
                self._remove(msg.request_id, msg.reason, msg.error)
            else:
                if isinstance(msg, Shutdown):
                    self.channel.closing = True
                self._handle(msg)
