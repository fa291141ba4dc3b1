"""The scheduler: the loop of the MLX worker thread.

Each turn it takes new requests and cancellations from its inbox, admits waiting
requests up to ``max_num_seqs``, runs prefill chunks up to a token budget (so a long
prompt never stalls running streams for long), lets finished prefills join the batch,
queues one batched decode step and reads back the previous one. Every request ends with
exactly one final event: a finish, a cancellation, or an error. A failure inside a step
fails the requests that step touched and leaves a clean batch behind.

Admission also keeps KV memory under its limit (see ``memory``): a request waits, first
come first served, until what it may come to hold fits beside what the admitted ones
may, cached prefixes being evicted first. The n copies of one prompt (a request's n
choices) are submitted together: the prompt is prefilled once and each copy samples
its own first token from those logits and joins the batch as a row of its own.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import mlx.core as mx

from .batch import Batch, JoiningRow
from .decode.store import slot_bucket
from .detokenize import TextAssembler
from .families import Family
from .grammar import GrammarCompiler, allowed_tokens
from .memory import (BufferCacheBound, Demand, Held, KVBudget, KVLayout, cache_bytes, format_bytes,
                     mlx_memory, resolve_limit)
from .prefill import Prefill, cache_key, prefix_cacheable
from .prefill_batch import PrefillGroup
from .prefix_cache import PrefixCache
from .sampling import BatchSampler, top_logprobs
from .turn_times import DecodeTimes
from .types import FinishReason, GenerationEvent, PreparedRequest, TokenLogprob

log = logging.getLogger("vlm_serve.engine")

# A turn longer than this (seconds) is logged with its parts: running streams stalled.
# At most one such line a SLOW_TURN_LOG_S, counting the slow turns it did not show.
SLOW_TURN_S = 0.25
SLOW_TURN_LOG_S = 1.0

Publish = Callable[[list[GenerationEvent]], None]


@dataclass
class Submit:
    request: PreparedRequest
    # More copies of the same prompt (the other choices of a request with n > 1): they
    # share the request's prefill.
    copies: list[PreparedRequest] = field(default_factory=list)


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
    tokens: list[int] = field(default_factory=list)  # the ids generated so far
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    done: bool = False
    finish_reason: FinishReason | None = None
    reused_tokens: int = 0  # prompt tokens served from the prefix cache
    matcher: object | None = None  # llguidance matcher of a constrained request
    # Copies of this prompt that join the batch from this state's prefill (n > 1).
    copies: list["RequestState"] = field(default_factory=list)
    waited_for_memory: bool = False
    admitted_turn: int = 0  # the scheduler's turn that admitted it to prefill

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def generated(self) -> int:
        return len(self.tokens)


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
    prefix_min_reuse: int = 1  # cached prefixes shorter than this are prefilled again
    # Prompt tokens prefilled between two decode steps: more means faster time to first
    # token for new requests, less means smoother streams for running ones.
    prefill_token_budget: int = 2048
    # Decode steps a new prompt may wait, while rows are decoding, for more prompts to
    # share its prefill passes (see ``Scheduler._gathering_prompts``); 0: none.
    prefill_wait_steps: int = 0
    # Pad last prefill passes to coarse lengths so their shapes repeat (on a GPU, where
    # a pass of a new length costs the host its per-shape setup; see
    # ``prefill.last_pass_length``).
    bucket_last_passes: bool = False
    stats_interval_s: float = 10.0
    # KV memory of running rows, prefills and cached prefixes: bytes with a unit
    # ("8GiB") or a fraction of the device's memory ("0.5"); None: the default (see
    # memory.resolve_limit).
    kv_cache_memory: str | None = None


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
            PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes, self._prefix_room,
                        config.prefix_min_reuse)
            if config.prefix_cache_entries > 0 and family.prefix_cache else None
        )
        self.memory = self._budget(model, family, config)
        self._quiet = False  # warm-up: requests end without a log line each
        self._outbox: list[GenerationEvent] = []
        self._inflight: Step | None = None
        self._joining: list[Step] = []  # rows whose first token is not read back yet
        self._ready: list[JoiningRow] = []  # prefilled this turn, joining the batch at its end
        self._stopping = False
        # Tests set this to inject a failure: called with the phase name and the
        # requests that phase is about to touch.
        self.fault_hook: Callable[[str, list[RequestState]], None] | None = None
        self._stats = {"generated": 0, "since": time.monotonic()}
        self.decode_times = DecodeTimes()  # where decode turns went, for the stats line
        self.waiting_rows = 0  # requests waiting or in prefill (copies included)
        self.kv_cache_bytes = 0  # held by the batch
        self.kv_memory_used = 0  # held by the batch, prefills and cached prefixes
        self.kv_memory_reserved = 0  # what admitted requests may come to hold, and the prefixes
        self.kv_memory_peak = 0  # most kv_memory_used seen at the end of a turn
        self.peak_running = 0  # most rows ever decoded together
        self.prefills = 0  # prompts prefilled (n copies of one prompt count once)
        self.memory_waits = 0  # requests that waited for KV memory to be admitted
        self.shared_prefill_rows = 0  # prompt passes run as rows of a shared pass
        self.shared_tower_requests = 0  # requests whose images ran in a shared tower call
        self.slow_turns = 0  # turns that held running streams up over SLOW_TURN_S
        self._slow_turn_logged = float("-inf")
        self._turns = 0  # turns taken; counts a prompt's wait in steps, the same on every rank
        self._admissions: deque[int] = deque(maxlen=64)  # the turns that admitted prompts lately

    def _budget(self, model, family: Family, config: SchedulerConfig) -> KVBudget:
        layout = KVLayout.probe(model.language_model)
        limit, how = resolve_limit(config.kv_cache_memory, model)
        try:  # whether text prompts prefill in chunks (bounds a sliding window's growth)
            text_chunks = bool(family.can_chunk_prefill(mx.array([[0]], mx.int32), None, [], {}))
        except Exception:  # noqa: BLE001 - unknown: assume whole-prompt prefill (larger)
            text_chunks = False
        windowed = any(layer.window for layer in layout.layers)
        budget = KVBudget(layout, limit, config.prefill_step_size, text_chunks,
                          short_copies=self.prefix_cache is not None and windowed,
                          slots=_slot_count(self.batch))
        log.info("KV cache memory limit: %s (%s); %s", format_bytes(limit), how, layout.describe())
        self.buffer_cache = bound = BufferCacheBound(limit, model)
        if bound.moving:
            log.info("freed buffers kept for reuse: at most %s less the KV that admitted requests "
                     "reserve (%s when idle)", format_bytes(max(bound.room, 0)), format_bytes(bound.idle_cap))
        else:
            log.info("freed buffers kept for reuse: at most %s", format_bytes(bound.idle_cap))
        return budget

    def stats(self) -> dict:
        """A snapshot for metrics; safe to read from another thread."""
        prefixes = self.prefix_cache
        vision = self.family.vision_cache
        return {
            "running": len(self.running),
            "waiting": self.waiting_rows,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_memory_used": self.kv_memory_used,
            "kv_memory_reserved": self.kv_memory_reserved,
            "kv_memory_peak": self.kv_memory_peak,
            "kv_memory_limit": self.memory.limit,
            "kv_memory_waits": self.memory_waits,
            "prefills": self.prefills,
            "slow_turns": self.slow_turns,
            # Running totals for /metrics: prompt tokens looked up in the prefix cache
            # and those whose KV came from it, and image sets whose vision features came
            # from the vision cache.
            "prefix_cache_queried_tokens": prefixes.queried_tokens if prefixes is not None else 0,
            "prefix_cache_hit_tokens": prefixes.reused_tokens if prefixes is not None else 0,
            "prefix_cache_bytes": prefixes.nbytes if prefixes is not None else 0,
            "prefix_cache_entries": len(prefixes) if prefixes is not None else 0,
            "prefix_cache_evictions": prefixes.evictions if prefixes is not None else 0,
            "vision_cache_hits": vision.hits,
            "vision_cache_evictions": vision.evictions,
            "vision_cache_entries": len(vision),
            "vision_cache_bytes": vision.bytes,
            "vision_cache_limit": vision.max_bytes,
        }

    # -- KV memory ----------------------------------------------------------------------

    def _demand(self) -> Demand:
        """What the admitted requests may come to hold (the prefix cache aside)."""
        demand = Demand()
        for state in self.running:
            self.memory.add(demand, state.request, prefilling=False)
        for state in self.prefilling:
            self.memory.add(demand, state.request, rows=1 + len(state.copies))
        return demand

    def _held(self) -> Held:
        """What the batch keeps allocated while rows live (a slot store's slots and
        full-attention columns), beyond what its rows need."""
        store = self.batch.store
        if store is None or not store.keys:
            return Held()
        columns = [k.shape[2] for k, kind in zip(store.keys, store.layer_kinds) if kind.window is None]
        return Held(store.slots, max(columns, default=0))

    def _reserved(self, demand: Demand) -> int:
        return self.memory.bytes(demand, self._held())

    def _prefix_room(self) -> int:
        """What cached prefixes may hold now, beside the admitted requests."""
        return self.memory.limit - self._reserved(self._demand())

    def _prefix_bytes(self) -> int:
        """What the cached prefixes hold."""
        return self.prefix_cache.nbytes if self.prefix_cache is not None else 0

    def _make_room(self, need: int) -> bool:
        """Whether ``need`` bytes of reservations fit, evicting cached prefixes (least
        recently stored first) if that is what it takes."""
        held = self._prefix_bytes()
        if need + held <= self.memory.limit:
            return True
        if need > self.memory.limit:
            return False
        self.prefix_cache.evict_to(self.memory.limit - need)
        return True

    def _account(self) -> None:
        """Measure what is held now (the caches' own sizes) and what is reserved. Read
        by other threads through ``stats`` (plain numbers, set here)."""
        self.waiting_rows = sum(1 + len(s.copies) for s in [*self.waiting, *self.prefilling])
        prefixes = self._prefix_bytes()
        prefills = sum(
            cache_bytes(s.prefill.cache) + cache_bytes(getattr(s.prefill, "short_cache", None))
            for s in self.prefilling if s.prefill is not None
        )
        groups = {id(s.prefill.group): s.prefill.group for s in self.prefilling
                  if s.prefill is not None and s.prefill.group is not None}
        prefills += sum(cache_bytes(g.cache) for g in groups.values())
        self.kv_cache_bytes = self.batch.nbytes
        self.kv_memory_used = self.kv_cache_bytes + prefills + prefixes
        self.kv_memory_reserved = self._reserved(self._demand()) + prefixes
        self.kv_memory_peak = max(self.kv_memory_peak, self.kv_memory_used)
        if self.running or self.prefilling or self._inflight:
            self.buffer_cache.busy(self.kv_memory_reserved)
        else:
            self.buffer_cache.idle()

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

    def run_to_completion(self, requests: list[PreparedRequest], copies: int = 0) -> None:
        """Serve ``requests`` to the end on this thread, publishing nothing (warm-up),
        each with ``copies`` more rows of its prompt (as a request with n > 1 has).
        Raises ``RuntimeError`` naming each request that ended in an error: a path that
        fails here would fail every user request that takes it."""
        errors: list[str] = []
        publish = self.publish
        self.publish = lambda events: errors.extend(f"{e.request_id}: {e.error}" for e in events if e.error)
        self._quiet = True
        try:
            for request in requests:
                more = [replace(request, request_id=f"{request.request_id}-{i}") for i in range(1, copies + 1)]
                self._handle(Submit(request, more))
            while self.waiting or self.prefilling or self.running or self._inflight:
                self._turn()
                self._flush()
        finally:
            self.publish = publish
            self._quiet = False
            self.decode_times.reset()  # the stats line shows served turns only
        if errors:
            raise RuntimeError("; ".join(errors))

    def _turn(self) -> None:
        idle = not (self.waiting or self.prefilling or self.running or self._inflight)
        self._take_inputs(idle)
        started = time.perf_counter()
        store = self.batch.store
        reallocations = store.reallocations if store is not None else 0
        self._turns += 1
        self._admit()
        budget, passes = self.config.prefill_token_budget, 0
        while self.prefilling and budget > 0 and not (passes == 0 and self._gathering_prompts()):
            budget -= self._prefill_step()
            passes += 1
        prefilled = time.perf_counter()
        joined = len(self._ready)
        self.batch.add(self._ready)
        self._ready = []
        self.peak_running = max(self.peak_running, len(self.running))
        joined_at = time.perf_counter()
        decoded = bool(self.running or self._inflight)
        if decoded:
            rows = len(self.running)
            self._decode_step()
            self.decode_times.turn(time.perf_counter() - started, rows)
        self._account()
        tokens = self.config.prefill_token_budget - budget
        reallocated = (store.reallocations if store is not None else 0) - reallocations
        if passes or joined or decoded:  # an idle turn holds no one up
            self._note_slow_turn(started, prefilled, joined_at, tokens, passes, joined, reallocated)

    def _note_slow_turn(self, started, prefilled, joined_at, tokens: int, passes: int,
                        joined: int, reallocated: int) -> None:
        """Log a turn that held the running streams up for long, with where it went."""
        now = time.perf_counter()
        if now - started < SLOW_TURN_S or self._quiet:
            return  # the warm-up's turns compile kernels first: its own line says how long
        self.slow_turns += 1
        if now - self._slow_turn_logged < SLOW_TURN_LOG_S:
            return
        store = self.batch.store
        log.info(
            "slow turn: %.0f ms (admission and prefill of %d tokens in %d steps %.0f ms, "
            "%d rows joining %.0f ms, decode of %d rows in %d slots %.0f ms%s); %d slow "
            "turns in all",
            1000 * (now - started), tokens, passes, 1000 * (prefilled - started), joined,
            1000 * (joined_at - prefilled), len(self.running),
            store.slots if store is not None else len(self.running), 1000 * (now - joined_at),
            f", the KV store reallocated to {store.slots} slots of {format_bytes(store.nbytes)}"
            if reallocated else "", self.slow_turns,
        )
        self._slow_turn_logged = now

    def _take_inputs(self, idle: bool) -> None:
        """Everything from outside this turn acts on: new requests, cancellations and
        deadlines. The rest of a turn follows from the scheduler's state alone, so a
        tensor-parallel follower that takes rank 0's inputs takes rank 0's steps
        (``vlm_serve.distributed.replica``)."""
        self._drain_inbox(block=idle)
        self._expire_deadlines()

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
            requests = [msg.request, *msg.copies]
            # Copies share a prefill as far as they can run together: within the batch's
            # size and the memory limit. A family served one row at a time prefills each.
            per = 1
            if self.family.batched and len(requests) > 1:
                per = self.memory.copies_per_prefill(msg.request, min(len(requests), self.config.max_num_seqs))
            for i in range(0, len(requests), per):
                leader, *copies = [self._new_state(r) for r in requests[i:i + per]]
                leader.copies = copies
                self.waiting.append(leader)
        elif isinstance(msg, Cancel):
            self._remove(msg.request_id, FinishReason.CANCELLED, None)
        elif isinstance(msg, Shutdown):
            self._stopping = True
        elif isinstance(msg, Abort):
            self._fail_all(msg.error, FinishReason.CANCELLED)

    def _new_state(self, request: PreparedRequest) -> RequestState:
        return RequestState(request, TextAssembler(self.detokenizer, request.sampling.stop))

    def _states(self) -> list[RequestState]:
        """Every request not finished yet: waiting, prefilling (copies too), running."""
        out = []
        for state in [*self.waiting, *self.prefilling]:
            out += [state, *state.copies]
        return out + self.running

    def _remove(self, request_id: str, reason: FinishReason, error: str | None) -> None:
        for queue_ in (self.waiting, self.prefilling):
            for i, state in enumerate(queue_):
                if state.id == request_id:
                    if state.copies:
                        # Its copies still need the prompt: the next one takes over the
                        # prefill (and its place in line).
                        heir = state.copies.pop(0)
                        heir.prefill, heir.copies = state.prefill, state.copies
                        state.prefill, state.copies = None, []
                        queue_[i] = heir
                    else:
                        del queue_[i]
                        if state.prefill is not None and state.prefill.group is not None:
                            state.prefill.group.drop(state.prefill)
                    self._finish(state, reason, error=error)
                    return
                for copy_ in state.copies:
                    if copy_.id == request_id:
                        state.copies.remove(copy_)
                        self._finish(copy_, reason, error=error)
                        return
        for state in self.running:
            if state.id == request_id:
                self._drop([state])
                self._finish(state, reason, error=error)
                return

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for state in self._states():
            deadline = state.request.deadline
            if deadline is not None and now > deadline:
                self._remove(state.id, FinishReason.TIMEOUT, "request timed out")

    def _admit(self) -> None:
        """Admit waiting requests in order while they fit: in the batch, and in KV
        memory beside what the admitted ones may come to hold. The first that does not
        fit waits, and everyone behind it, so a large request is never starved."""
        if not self.waiting:
            return  # measuring the admitted requests' demand walks every one of them
        limit = self.config.max_num_seqs if self.family.batched else 1
        demand = self._demand()
        admitted = False
        while self.waiting:
            state = self.waiting[0]
            rows = 1 + len(state.copies)
            if demand.rows + rows > limit:
                break
            trial = replace(demand)
            self.memory.add(trial, state.request, rows=rows)
            group = [state, *state.copies]
            if not self._make_room(self._reserved(trial)):
                need = self.memory.alone(state.request, rows)
                if need > self.memory.limit:
                    # Never fits (the API refuses these before they queue): end it
                    # rather than hold up everyone behind it.
                    self.waiting.popleft()
                    for member in group:
                        self._finish(member, FinishReason.ERROR, error=(
                            f"needs {format_bytes(need)} of KV cache, over the limit of "
                            f"{format_bytes(self.memory.limit)}"))
                    continue
                if not state.waited_for_memory:
                    state.waited_for_memory = True
                    self.memory_waits += 1
                break
            self.waiting.popleft()
            if state.request.sampling.grammar is not None:
                try:
                    for member in group:
                        member.matcher = self.grammars.matcher(member.request.sampling.grammar)
                except Exception as exc:  # noqa: BLE001 - only this request's grammar is bad
                    for member in group:
                        self._finish(member, FinishReason.ERROR, error=f"grammar failed: {exc}")
                    continue
            demand, admitted = trial, True
            state.prefill = self._new_prefill(state)
            state.admitted_turn = self._turns
            self._admissions.append(self._turns)
            self.prefilling.append(state)
        if admitted:
            # The buffer cache's cap drops to what the new reservations leave before
            # their prefill allocates (``_account`` sets it again after the turn).
            self.buffer_cache.busy(self._reserved(demand) + self._prefix_bytes(), trim=False)

    # -- prefill ----------------------------------------------------------------------

    def _prefill_step(self) -> int:
        """One prefill step of the first request in line (and of the prompts it shares
        passes with); returns its token cost."""
        state = self.prefilling[0]
        prefill = state.prefill
        if self.family.batch_prefill and prefill.may_group:
            self._group_from(state)
        group = prefill.group
        states = self._group_states(group) if group is not None else [state]
        try:
            if self.fault_hook:
                self.fault_hook("prefill", [m for s in states for m in (s, *s.copies)])
            cost = (group or prefill).step()
            if group is not None:
                self.shared_prefill_rows += group.shared_rows
                self.shared_tower_requests += group.shared_towers
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this prompt
            if group is not None:
                # Which prompt of a shared step failed is not known: each starts over
                # alone, so a bad one fails by itself and the others go on.
                log.warning("shared prefill of %d prompts failed (%s); each starts over alone",
                            len(states), exc)
                for member in states:
                    self._restart_alone(member)
                return 1
            log.exception("prefill failed for %s (%s)", state.id, mlx_memory())
            self.prefilling.remove(state)
            for member in (state, *state.copies):
                self._finish(member, FinishReason.ERROR, error=f"prefill failed: {exc}")
            return 1
        for member in states:
            if member.prefill is not None and member.prefill.done:
                self._join(member)
        return cost

    def _gathering_prompts(self) -> bool:
        """Whether the prompts admitted to prefill wait this turn for more to share their
        passes. On a GPU a pass costs the host about as much for one prompt as for seven
        (MLX launches its kernels one by one), so a loaded server that prefills each
        arrival alone spends much of its time launching passes. They wait only while
        rows are decoding (no one idles), none has started, the first may share a pass,
        more may still come and fit in it, and for at most ``prefill_wait_steps``
        decode steps from the first one's admission; and only while prompts have been
        arriving about as often as that lately, so that at light load a prompt never
        waits for no one. Counted in turns, not seconds, so every tensor-parallel rank
        decides the same."""
        wait, family = self.config.prefill_wait_steps, self.family
        if wait <= 0 or not self.running or self.waiting or not family.batch_prefill:
            return False
        head = self.prefilling[0]
        if self._turns - head.admitted_turn >= wait:
            return False
        # At least one admission per ``wait`` turns over the last 4 * wait turns.
        if sum(self._turns - turn < 4 * wait for turn in self._admissions) < 4:
            return False
        if not self._may_share(head):
            return False
        tokens = rows = 0
        for state in self.prefilling:
            if not state.prefill.may_group:
                return False  # a prompt under way goes on
            tokens += self._first_pass_tokens(state)
            rows += 1 + len(state.copies)
        return tokens < self.config.prefill_token_budget and len(self.running) + rows < self.config.max_num_seqs

    def _group_from(self, head: RequestState) -> None:
        """Prompts in line that may share ``head``'s prefill passes, up to what one
        shared pass may cost within the prefill token budget."""
        budget = self.config.prefill_token_budget
        chosen, cost = [], 0
        for state in self.prefilling:
            if not (state.prefill.may_group and self._may_share(state)):
                continue
            tokens = self._first_pass_tokens(state)
            if chosen and cost + tokens > budget:
                break
            chosen.append(state.prefill)
            cost += tokens
        if len(chosen) > 1 and chosen[0] is head.prefill:
            PrefillGroup(self.model, self.family, chosen)

    def _may_share(self, state: RequestState) -> bool:
        """Whether the family lets this prompt share passes (text always; images only
        where it batches their passes or their tower calls)."""
        family = self.family
        return not state.request.has_media or family.batch_prefill_images or family.batch_vision

    def _first_pass_tokens(self, state: RequestState) -> int:
        """What this prompt's first pass costs of the prefill token budget."""
        return min(self.config.prefill_step_size, state.request.num_prompt_tokens)

    def _group_states(self, group: PrefillGroup) -> list[RequestState]:
        return [s for s in self.prefilling if s.prefill is not None and s.prefill.group is group]

    def _restart_alone(self, state: RequestState) -> None:
        state.prefill = self._new_prefill(state)
        state.prefill.alone = True

    def _new_prefill(self, state: RequestState) -> Prefill:
        return Prefill(self.model, self.family, state.request, self.config.prefill_step_size,
                       self.prefix_cache, self.config.bucket_last_passes)

    def _join(self, state: RequestState) -> None:
        """A finished prefill: its prompt's rows join the batch at the end of the turn."""
        group = [state, *state.copies]
        prefill = state.prefill
        try:
            rows, steps = [], []
            for i, member in enumerate(group):
                # Each copy samples its own first token (its own seed) from the shared
                # logits, and joins as a row of its own: the batch copies the prompt's
                # cache into every row. Its first token is read back right after the
                # next decode step is queued, so the device never idles on the way.
                sampler = BatchSampler(self.vocab_size)
                sampler.add(member.request.sampling, member.request.input_ids.tolist(), self.eos_token_ids)
                out = sampler.sample(prefill.logits, allowed_tokens([member.matcher], self.vocab_size))
                row_state = prefill.row_state
                if i > 0 and row_state is not None:
                    row_state = dict(row_state)  # families update it per row
                rows.append(JoiningRow(prefill.cache, sampler, out.tokens, row_state))
                steps.append(Step(out, [member], self._logprob_arrays(out, [member])))
            # The prompt's last pass and its first tokens go to the device now, on
            # their own: queued only with the next decode step, a first token could be
            # read back only once that whole step had run, not once the prefill had.
            mx.async_eval([a for step in steps for a in (step.out.tokens, *step.extras)])
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this prompt
            log.exception("prefill failed for %s (%s)", state.id, mlx_memory())
            self.prefilling.remove(state)
            for member in group:
                self._finish(member, FinishReason.ERROR, error=f"prefill failed: {exc}")
            return
        self.prefilling.remove(state)
        state.prefill, state.copies = None, []
        self.prefills += 1
        for member in group:
            member.reused_tokens = prefill.reused
        self._ready += rows
        self.running += group
        self._joining += steps
        try:
            # Now that its rows count as running, the prompt's cache is offered to the
            # prefix cache, within the room the memory budget leaves.
            prefill.remember()
        except Exception:  # noqa: BLE001 - a cache that is not kept fails no request
            log.exception("could not keep the prefix of %s", state.id)

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
                self._flush()  # these tokens need not wait for the next step's launch
                self._inflight = self._launch() if self.running else None
                return
            joined = {id(s) for step in joining for s in step.states}
            if joining and all(id(s) in joined for s in self.running):
                # The joining rows are the whole batch (it was idle, or its last rows
                # just left): their first tokens go out before its next step is built
                # (7-10 ms of host time for one row on an H100), as no other row waits
                # on that step. A step still in flight holds only rows that left.
                for step in joining:
                    self._process(step)
                joining = []
                self._flush()  # to the event loop now, not at the turn's end after the launch
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
            log.exception("decode step failed for %d requests (%s)", len(touched), mlx_memory())
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
        times = self.decode_times
        since = time.perf_counter()
        out = self.batch.step(allowed_tokens([s.matcher for s in states], self.vocab_size))
        extras = self._logprob_arrays(out, states)
        since = times.add("build", since)
        mx.async_eval(out.tokens, *extras)
        times.add("queue", since)
        return Step(out, states, extras)

    def _process(self, step: "Step") -> None:
        times = self.decode_times
        since = time.perf_counter()
        tokens, logprobs = self._read(step.out, step.states, step.extras)
        since = times.add("wait", since)
        finished = []
        for i, state in enumerate(step.states):
            if state.done:
                continue  # left the batch after this step was queued
            if self._accept(state, tokens[i], logprobs[i]):
                finished.append(state)
        self._stats["generated"] += len(step.states)
        since = times.add("rows", since)
        if finished:
            # Their last events go to the event loop before their KV is copied out for
            # the prefix cache (host work for every layer of every finished row).
            self._flush()
            self._keep_answers(finished)
            self._drop(finished)
            times.add("leave", since)
        self.kv_cache_bytes = self.batch.nbytes

    def _drop(self, states: list[RequestState]) -> None:
        gone = {id(s) for s in states}
        keep = [i for i, s in enumerate(self.running) if id(s) not in gone]
        self.batch.keep(keep)
        self.running = [self.running[i] for i in keep]

    def _keep_answers(self, states: list[RequestState]) -> None:
        """Offer the KV of rows that finished (their prompt and the answer so far) to
        the prefix cache before they leave: a chat client's next turn resends both, and
        then prefills only what it adds. Rows that failed keep nothing."""
        if self.prefix_cache is None:
            return
        rows = {id(s): i for i, s in enumerate(self.running)}
        for state in states:
            request = state.request
            if state.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) or not (
                prefix_cacheable(self.family, request)
            ):
                continue
            tokens = request.input_ids.tolist() + state.tokens
            if not self.prefix_cache.fits(self.memory.layout.cache_bytes(len(tokens))):
                continue  # copied out only to be refused: no room under the budget
            try:
                cache = self.batch.row_cache(rows[id(state)])
                if cache is None:
                    return  # this batch's caches cannot be split per row
                held = cache[0].offset  # the prompt and the tokens decoded from so far
                if len(request.input_ids) < held <= len(tokens):
                    self.prefix_cache.store(cache_key(self.family, request, tokens[:held]), cache)
            except Exception:  # noqa: BLE001 - a cache that is not kept fails no request
                log.exception("could not keep the answer of %s", state.id)

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
        state.tokens.append(token)
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
        state.finish_reason = reason
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
        log.log(
            logging.DEBUG if self._quiet else logging.INFO,
            "request %s done: prompt_tokens=%d cached_tokens=%d images=%d completion_tokens=%d "
            "ttft=%s tokens/s=%s finish=%s%s",
            state.id, state.request.num_prompt_tokens, state.reused_tokens, state.request.num_images,
            state.generated, ttft, tps, reason.value, f" error={error}" if error else "",
        )

    def _fail_all(self, error: str, reason: FinishReason) -> None:
        for state in self._states():
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
                "engine: running=%d prefilling=%d waiting=%d generation=%.1f tokens/s "
                "kv_memory=%s reserved=%s limit=%s prefix_cache=%d entries %s mlx_cache_cap=%s "
                "(trimmed %d times); %s",
                len(self.running), len(self.prefilling), len(self.waiting),
                self._stats["generated"] / elapsed, format_bytes(self.kv_memory_used),
                format_bytes(self.kv_memory_reserved), format_bytes(self.memory.limit),
                len(self.prefix_cache) if self.prefix_cache is not None else 0, mlx_memory(),
                format_bytes(self.buffer_cache.cap), self.buffer_cache.trims, self.decode_times.describe(),
            )
        self._stats = {"generated": 0, "since": now}
        self.decode_times.reset()


def _slot_count(batch) -> Callable[[int], int]:
    """How many slots the batch allocates for a number of rows: a slot store rounds up
    to its buckets; mlx-lm's batch caches hold exactly the rows."""
    return slot_bucket if batch.store is not None else (lambda rows: rows)
