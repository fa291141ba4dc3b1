"""The scheduler: the loop of the MLX worker thread.

Each turn it takes new requests and cancellations from its inbox, admits waiting
requests up to ``max_num_seqs``, runs one prefill chunk (so a long prompt never stalls
running streams for long), and one batched decode step. Every request ends with exactly
one final event: a finish, a cancellation, or an error. A failure inside a step fails
the requests that step touched and leaves a clean batch behind.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from .adapters import ModelAdapter
from .batch import Batch
from .detokenize import TextAssembler
from .prefill import Prefill
from .sampling import BatchSampler, top_logprobs
from .types import FinishReason, GenerationEvent, PreparedRequest, TokenLogprob

log = logging.getLogger("vlm_serve.engine")

Publish = Callable[[list[GenerationEvent]], None]


@dataclass
class Submit:
    request: PreparedRequest


@dataclass
class Cancel:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class RequestState:
    request: PreparedRequest
    text: TextAssembler
    prefill: Prefill | None = None
    generated: int = 0
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    @property
    def id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32
    prefill_step_size: int = 512
    stats_interval_s: float = 10.0


class Scheduler:
    def __init__(
        self,
        model,
        adapter: ModelAdapter,
        detokenizer,
        eos_token_ids: set[int],
        vocab_size: int,
        publish: Publish,
        config: SchedulerConfig,
    ):
        self.model = model
        self.adapter = adapter
        self.detokenizer = detokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.publish = publish
        self.config = config
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: deque[RequestState] = deque()
        self.prefilling: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.batch = Batch(model, adapter, vocab_size)
        self._outbox: list[GenerationEvent] = []
        self._stopping = False
        # Tests set this to inject a failure: called with the phase name and the
        # requests that phase is about to touch.
        self.fault_hook: Callable[[str, list[RequestState]], None] | None = None
        self._stats = {"generated": 0, "since": time.monotonic()}
        self.kv_cache_bytes = 0

    def stats(self) -> dict:
        """A snapshot for metrics; safe to read from another thread."""
        return {
            "running": len(self.running),
            "waiting": len(self.waiting) + len(self.prefilling),
            "kv_cache_bytes": self.kv_cache_bytes,
        }

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping:
            idle = not (self.waiting or self.prefilling or self.running)
            self._drain_inbox(block=idle)
            self._expire_deadlines()
            self._admit()
            if self.prefilling:
                self._prefill_step()
            if self.running:
                self._decode_step()
            self._flush()
            self._log_stats()
        self._fail_all("server is shutting down", FinishReason.CANCELLED)
        self._flush()

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg) -> None:
        if isinstance(msg, Submit):
            req = msg.request
            state = RequestState(req, TextAssembler(self.detokenizer, req.sampling.stop))
            self.waiting.append(state)
        elif isinstance(msg, Cancel):
            self._remove(msg.request_id, FinishReason.CANCELLED, None)
        elif isinstance(msg, Shutdown):
            self._stopping = True

    def _remove(self, request_id: str, reason: FinishReason, error: str | None) -> None:
        for queue_ in (self.waiting, self.prefilling):
            for state in list(queue_):
                if state.id == request_id:
                    queue_.remove(state)
                    self._finish(state, reason, error=error)
                    return
        for i, state in enumerate(self.running):
            if state.id == request_id:
                keep = [j for j in range(len(self.running)) if j != i]
                self.batch.keep(keep)
                self.running = [self.running[j] for j in keep]
                self._finish(state, reason, error=error)
                return

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for state in [*self.waiting, *self.prefilling, *self.running]:
            deadline = state.request.deadline
            if deadline is not None and now > deadline:
                self._remove(state.id, FinishReason.TIMEOUT, "request timed out")

    def _admit(self) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.config.max_num_seqs:
            state = self.waiting.popleft()
            state.prefill = Prefill(
                self.model, self.adapter, state.request, self.config.prefill_step_size
            )
            self.prefilling.append(state)

    # -- prefill ----------------------------------------------------------------------

    def _prefill_step(self) -> None:
        state = self.prefilling[0]
        try:
            if self.fault_hook:
                self.fault_hook("prefill", [state])
            state.prefill.step()
            if not state.prefill.done:
                return
            self.prefilling.popleft()
            sampler = BatchSampler(self.vocab_size)
            sampler.add(state.request.sampling, state.request.input_ids.tolist())
            out = sampler.sample(state.prefill.logits)
            token, logprobs = self._evaluate(out, [state])
            prefill, state.prefill = state.prefill, None
            if not self._accept(state, token[0], logprobs[0]):
                row_state = self.adapter.row_state(prefill.kwargs)
                self.batch.add(prefill.cache, sampler, token[0], row_state)
                self.running.append(state)
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this request
            log.exception("prefill failed for %s", state.id)
            if self.prefilling and self.prefilling[0] is state:
                self.prefilling.popleft()
            self._finish(state, FinishReason.ERROR, error=f"prefill failed: {exc}")

    # -- decode -----------------------------------------------------------------------

    def _decode_step(self) -> None:
        touched = list(self.running)
        try:
            if self.fault_hook:
                self.fault_hook("decode", touched)
            out = self.batch.step()
            tokens, logprobs = self._evaluate(out, touched)
        except Exception as exc:  # noqa: BLE001 - fail this step's rows, keep serving
            log.exception("decode step failed for %d requests", len(touched))
            self.batch.reset()
            self.running = []
            for state in touched:
                self._finish(state, FinishReason.ERROR, error=f"decode step failed: {exc}")
            return
        keep = []
        for i, state in enumerate(touched):
            if not self._accept(state, tokens[i], logprobs[i]):
                keep.append(i)
                self.batch.last_tokens[i] = tokens[i]
        self.batch.keep(keep)
        self.running = [touched[i] for i in keep]
        self._stats["generated"] += len(touched)
        self.kv_cache_bytes = self.batch.nbytes

    def _evaluate(self, out, states: list[RequestState]):
        """Bring the sampled tokens (and logprobs where asked) to the host."""
        k = max((s.request.sampling.top_logprobs for s in states), default=0)
        want = any(s.request.sampling.logprobs for s in states)
        if not want:
            mx.eval(out.tokens)
            return out.tokens.tolist(), [None] * len(states)
        chosen, ids, vals = top_logprobs(out.logprobs, out.tokens, k)
        mx.eval(out.tokens, chosen, ids, vals)
        tokens, chosen, ids, vals = out.tokens.tolist(), chosen.tolist(), ids.tolist(), vals.tolist()
        logprobs = []
        for i, s in enumerate(states):
            if not s.request.sampling.logprobs:
                logprobs.append(None)
                continue
            n = s.request.sampling.top_logprobs
            logprobs.append(TokenLogprob(tokens[i], chosen[i], list(zip(ids[i][:n], vals[i][:n]))))
        return tokens, logprobs

    # -- per-token bookkeeping ----------------------------------------------------------

    def _accept(self, state: RequestState, token: int, logprob: TokenLogprob | None) -> bool:
        """Account one sampled token; returns True when the request has finished."""
        params = state.request.sampling
        state.generated += 1
        if state.first_token_at is None:
            state.first_token_at = time.monotonic()
        is_eos = not params.ignore_eos and token in self.eos_token_ids
        if is_eos or token in params.stop_token_ids:
            self._finish(state, FinishReason.STOP, token=token)
            return True
        text = state.text.add_token(token)
        if state.text.stopped:
            self._finish(state, FinishReason.STOP, text=text, token=token, logprob=logprob)
            return True
        if state.generated >= params.max_tokens:
            self._finish(state, FinishReason.LENGTH, text=text, token=token, logprob=logprob)
            return True
        self._outbox.append(
            GenerationEvent(
                state.id,
                text=text,
                token_ids=[token],
                logprobs=[logprob] if logprob else [],
                prompt_tokens=state.request.num_prompt_tokens,
                completion_tokens=state.generated,
            )
        )
        return False

    def _finish(
        self,
        state: RequestState,
        reason: FinishReason,
        *,
        text: str = "",
        token: int | None = None,
        logprob: TokenLogprob | None = None,
        error: str | None = None,
    ) -> None:
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            text += state.text.finish()
        now = time.monotonic()
        stats = {
            "ttft_s": (state.first_token_at - state.arrived) if state.first_token_at else None,
            "decode_tps": (
                (state.generated - 1) / (now - state.first_token_at)
                if state.first_token_at and state.generated > 1 and now > state.first_token_at
                else None
            ),
            "e2e_s": now - state.arrived,
        }
        self._outbox.append(
            GenerationEvent(
                state.id,
                text=text,
                token_ids=[token] if token is not None else [],
                logprobs=[logprob] if logprob else [],
                finish_reason=reason,
                prompt_tokens=state.request.num_prompt_tokens,
                completion_tokens=state.generated,
                error=error,
                stats=stats,
            )
        )
        ttft = f"{stats['ttft_s'] * 1000:.0f}ms" if stats["ttft_s"] is not None else "-"
        tps = f"{stats['decode_tps']:.1f}" if stats["decode_tps"] is not None else "-"
        log.info(
            "request %s done: prompt_tokens=%d images=%d completion_tokens=%d ttft=%s "
            "tokens/s=%s finish=%s%s",
            state.id, state.request.num_prompt_tokens, state.request.num_images,
            state.generated, ttft, tps, reason.value, f" error={error}" if error else "",
        )

    def _fail_all(self, error: str, reason: FinishReason) -> None:
        for state in [*self.waiting, *self.prefilling, *self.running]:
            self._finish(state, reason, error=error)
        self.waiting.clear()
        self.prefilling.clear()
        self.running = []
        self.batch.reset()

    def _flush(self) -> None:
        if self._outbox:
            events, self._outbox = self._outbox, []
            self.publish(events)

    def _log_stats(self) -> None:
        now = time.monotonic()
        elapsed = now - self._stats["since"]
        if elapsed < self.config.stats_interval_s:
            return
        if self.running or self.waiting or self.prefilling or self._stats["generated"]:
            log.info(
                "engine: running=%d prefilling=%d waiting=%d generation=%.1f tokens/s",
                len(self.running), len(self.prefilling), len(self.waiting),
                self._stats["generated"] / elapsed,
            )
        self._stats = {"generated": 0, "since": now}
