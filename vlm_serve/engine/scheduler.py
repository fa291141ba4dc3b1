"""The scheduler: the loop of the MLX worker thread.

Each turn it takes new requests and cancellations from its inbox, admits waiting
requests up to ``max_num_seqs``, runs prefill chunks up to a token budget (so a long
prompt never stalls running streams for long), lets finished prefills join the batch,
queues one batched decode step and reads back the previous one. Every request ends with
exactly one final event: a finish, a cancellation, or an error. A failure inside a step
fails the requests that step touched and leaves a clean batch behind.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from .batch import Batch, JoiningRow
from .detokenize import TextAssembler
from .families import Family
from .grammar import GrammarCompiler, allowed_tokens
from .prefill import Prefill
from .prefix_cache import PrefixCache
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
class Abort:
    """End every request now with this error (the server's shutdown grace ran out)."""

    error: str


@dataclass
class RequestState:
    request: PreparedRequest
    text: TextAssembler
    prefill: Prefill | None = None
    generated: int = 0
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    done: bool = False
    reused_tokens: int = 0  # prompt tokens served from the prefix cache
    matcher: object | None = None  # llguidance matcher of a constrained request

    @property
    def id(self) -> str:
        return self.request.request_id


@dataclass
class Step:
    """A queued decode step: its lazy outputs and the rows it was queued for."""

    out: object
    states: list[RequestState]
    extras: tuple = ()


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32
    prefill_step_size: int = 512
    prefix_cache_entries: int = 16  # prompts kept for prefix reuse; 0: off
    prefix_cache_bytes: int = 2 << 30
    # Prompt tokens prefilled between two decode steps: more means faster time to first
    # token for new requests, less means smoother streams for running ones.
    prefill_token_budget: int = 2048
    stats_interval_s: float = 10.0


class Scheduler:
    def __init__(
        self,
        model,
        family: Family,
        tokenizer,
        detokenizer,
        eos_token_ids: set[int],
        vocab_size: int,
        publish: Publish,
        config: SchedulerConfig,
    ):
        self.model = model
        self.family = family
        self.detokenizer = detokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.publish = publish
        self.config = config
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: deque[RequestState] = deque()
        self.prefilling: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.batch = Batch(model, family, vocab_size)
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.prefix_cache = (
            PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes)
            if config.prefix_cache_entries > 0 and family.prefix_cache else None
        )
        self._outbox: list[GenerationEvent] = []
        self._inflight: Step | None = None
        self._joining: list[Step] = []  # rows whose first token is not read back yet
        self._ready: list[JoiningRow] = []  # prefilled this turn, joining the batch at its end
        self._stopping = False
        # Tests set this to inject a failure: called with the phase name and the
        # requests that phase is about to touch.
        self.fault_hook: Callable[[str, list[RequestState]], None] | None = None
        self._stats = {"generated": 0, "since": time.monotonic()}
        self.kv_cache_bytes = 0
        self.peak_running = 0  # most rows ever decoded together

    def stats(self) -> dict:
        """A snapshot for metrics; safe to read from another thread."""
        return {
            "running": len(self.running),
            "waiting": len(self.waiting) + len(self.prefilling),
            "kv_cache_bytes": self.kv_cache_bytes,
            # Running totals for /metrics: prompt tokens whose KV came from the prefix
            # cache, and image sets whose vision features came from the vision cache.
            "prefix_cache_hit_tokens": self.prefix_cache.reused_tokens if self.prefix_cache else 0,
            "vision_cache_hits": getattr(getattr(self.family, "vision_cache", None), "hits", 0),
        }

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping:
            try:
                self._turn()
            except Exception as exc:  # noqa: BLE001 - last resort: never leave a request hanging
                log.exception("scheduler turn failed")
                self._fail_all(f"internal error: {exc}", FinishReason.ERROR)
            self._flush()
            self._log_stats()
        self._fail_all("server is shutting down", FinishReason.CANCELLED)
        self._flush()

    def run_to_completion(self, requests: list[PreparedRequest]) -> None:
        """Serve ``requests`` to the end on this thread, publishing nothing (warm-up)."""
        publish, self.publish = self.publish, lambda events: None
        try:
            for request in requests:
                self._handle(Submit(request))
            while self.waiting or self.prefilling or self.running or self._inflight:
                self._turn()
                self._flush()
        finally:
            self.publish = publish

    def _turn(self) -> None:
        idle = not (self.waiting or self.prefilling or self.running or self._inflight)
        self._drain_inbox(block=idle)
        self._expire_deadlines()
        self._admit()
        budget = self.config.prefill_token_budget
        while self.prefilling and budget > 0:
            budget -= self._prefill_step()
        self.batch.add(self._ready)
        self._ready = []
        self.peak_running = max(self.peak_running, len(self.running))
        if self.running or self._inflight:
            self._decode_step()

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
        elif isinstance(msg, Abort):
            self._fail_all(msg.error, FinishReason.CANCELLED)

    def _remove(self, request_id: str, reason: FinishReason, error: str | None) -> None:
        for queue_ in (self.waiting, self.prefilling):
            for state in list(queue_):
                if state.id == request_id:
                    queue_.remove(state)
                    self._finish(state, reason, error=error)
                    return
        for state in self.running:
            if state.id == request_id:
                self._drop([state])
                self._finish(state, reason, error=error)
                return

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for state in [*self.waiting, *self.prefilling, *self.running]:
            deadline = state.request.deadline
            if deadline is not None and now > deadline:
                self._remove(state.id, FinishReason.TIMEOUT, "request timed out")

    def _admit(self) -> None:
        limit = self.config.max_num_seqs if self.family.batched else 1
        while self.waiting and len(self.running) + len(self.prefilling) < limit:
            state = self.waiting.popleft()
            if state.request.sampling.grammar is not None:
                try:
                    state.matcher = self.grammars.matcher(state.request.sampling.grammar)
                except Exception as exc:  # noqa: BLE001 - only this request's grammar is bad
                    self._finish(state, FinishReason.ERROR, error=f"grammar failed: {exc}")
                    continue
            state.prefill = Prefill(
                self.model, self.family, state.request, self.config.prefill_step_size,
                self.prefix_cache,
            )
            self.prefilling.append(state)

    # -- prefill ----------------------------------------------------------------------

    def _prefill_step(self) -> int:
        """One prefill chunk of the first request in line; returns its token cost."""
        state = self.prefilling[0]
        try:
            if self.fault_hook:
                self.fault_hook("prefill", [state])
            cost = state.prefill.step()
            if not state.prefill.done:
                return cost
            self.prefilling.popleft()
            sampler = BatchSampler(self.vocab_size)
            sampler.add(state.request.sampling, state.request.input_ids.tolist(), self.eos_token_ids)
            allowed = allowed_tokens([state.matcher], self.vocab_size)
            out = sampler.sample(state.prefill.logits, allowed)
            prefill, state.prefill = state.prefill, None
            prefill.remember()
            state.reused_tokens = prefill.reused
            # The row joins with its first token still lazy; it is read back right after
            # the next decode step is queued, so the device never idles on the way.
            row = JoiningRow(prefill.cache, sampler, out.tokens, prefill.row_state)
            first = Step(out, [state], self._logprob_arrays(out, [state]))
            self._ready.append(row)
            self.running.append(state)
            self._joining.append(first)
            return cost
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this request
            log.exception("prefill failed for %s", state.id)
            if self.prefilling and self.prefilling[0] is state:
                self.prefilling.popleft()
            self._finish(state, FinishReason.ERROR, error=f"prefill failed: {exc}")
            return 1

    # -- decode -----------------------------------------------------------------------

    def _decode_step(self) -> None:
        """Queue the next batched step, then read back the one queued last time.

        The step in flight takes its input tokens lazily from the step before, so the
        device never waits for Python's bookkeeping (detokenizing, stop checks, events).
        A row that finishes is dropped one step late; that one step is discarded.
        """
        joining, self._joining = self._joining, []
        try:
            if any(s.matcher is not None for s in self.running):
                # A grammar needs the last token before it can mask the next one: read
                # everything back first, then queue the next step.
                previous, self._inflight = self._inflight, None
                for step in (*joining, previous):
                    if step is not None:
                        self._process(step)
                self._inflight = self._launch() if self.running else None
                return
            launched = self._launch() if self.running else None
            previous, self._inflight = self._inflight, launched
            for step in joining:  # first tokens of rows that just joined
                self._process(step)
            if previous is not None:
                self._process(previous)
        except Exception as exc:  # noqa: BLE001 - fail the batch's rows, keep serving
            touched = {id(s): s for s in self.running}
            for step in (self._inflight, *joining):
                if step is not None:
                    touched.update({id(s): s for s in step.states})
            log.exception("decode step failed for %d requests", len(touched))
            self.batch.reset()
            self.running = []
            self._inflight = None
            for state in touched.values():
                if not state.done:
                    self._finish(state, FinishReason.ERROR, error=f"decode step failed: {exc}")

    def _launch(self) -> "Step":
        states = list(self.running)
        if self.fault_hook:
            self.fault_hook("decode", states)
        out = self.batch.step(allowed_tokens([s.matcher for s in states], self.vocab_size))
        extras = self._logprob_arrays(out, states)
        mx.async_eval(out.tokens, *extras)
        return Step(out, states, extras)

    def _process(self, step: "Step") -> None:
        tokens, logprobs = self._read(step.out, step.states, step.extras)
        finished = []
        for i, state in enumerate(step.states):
            if state.done:
                continue  # left the batch after this step was queued
            if self._accept(state, tokens[i], logprobs[i]):
                finished.append(state)
        self._stats["generated"] += len(step.states)
        if finished:
            self._drop(finished)
        self.kv_cache_bytes = self.batch.nbytes

    def _drop(self, states: list[RequestState]) -> None:
        gone = {id(s) for s in states}
        keep = [i for i, s in enumerate(self.running) if id(s) not in gone]
        order = self.batch.keep(keep)  # the batch may reorder its rows
        self.running = [self.running[i] for i in order]

    def _logprob_arrays(self, out, states: list[RequestState]) -> tuple:
        if not any(s.request.sampling.logprobs for s in states):
            return ()
        k = max(s.request.sampling.top_logprobs for s in states)
        return top_logprobs(out.logprobs, out.tokens, k)

    def _read(self, out, states: list[RequestState], extras: tuple):
        """Bring sampled tokens (and logprobs where asked) to the host."""
        tokens = out.tokens.tolist()
        if not extras:
            return tokens, [None] * len(states)
        chosen, ids, vals = (a.tolist() for a in extras)
        logprobs = []
        for i, s in enumerate(states):
            n = s.request.sampling.top_logprobs
            logprobs.append(
                TokenLogprob(tokens[i], chosen[i], list(zip(ids[i][:n], vals[i][:n])))
                if s.request.sampling.logprobs else None
            )
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
        if state.matcher is not None and not state.matcher.consume_token(token):
            self._finish(state, FinishReason.ERROR, error=f"grammar rejected token {token}")
            return True
        text = state.text.add_token(token)
        if state.text.stopped or (state.matcher is not None and state.matcher.is_stopped()):
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
        state.done = True
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
            "cached_tokens": state.reused_tokens,
            "stop_string": state.text.stop_string,
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
            "request %s done: prompt_tokens=%d cached_tokens=%d images=%d completion_tokens=%d "
            "ttft=%s tokens/s=%s finish=%s%s",
            state.id, state.request.num_prompt_tokens, state.reused_tokens, state.request.num_images,
            state.generated, ttft, tps, reason.value, f" error={error}" if error else "",
        )

    def _fail_all(self, error: str, reason: FinishReason) -> None:
        for state in [*self.waiting, *self.prefilling, *self.running]:
            if not state.done:
                self._finish(state, reason, error=error)
        self.waiting.clear()
        self.prefilling.clear()
        self.running = []
        self._inflight = None
        self._joining = []
        self._ready = []
        self.batch.reset()

    def release(self) -> None:
        """Drop every MLX array this scheduler holds (the worker thread is ending)."""
        self._fail_all("server is shutting down", FinishReason.CANCELLED)
        self._flush()
        self.model = self.family = self.batch = self.prefix_cache = self.grammars = None

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
