"""The engine front: owns the MLX worker thread and routes its events to requests.

The event loop calls ``submit``/``cancel``; the worker thread loads the model and runs
the scheduler; events come back in one batch per step through
``loop.call_soon_threadsafe`` into one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from contextvars import ContextVar
from typing import AsyncIterator

from . import loader, quantized_check, weight_layout
from .families import family_for
from .memory import KVBudget
from .scheduler import Abort, Cancel, Scheduler, SchedulerConfig, Shutdown, Submit
from .types import FinishReason, GenerationEvent, PreparedRequest
from .vision_cache import DEFAULT_MAX_BYTES as DEFAULT_VISION_CACHE_BYTES
from .warmup import warm_up

log = logging.getLogger("vlm_serve.engine")

# The access-log record of the HTTP request being served, set by the API's middleware:
# submit and the request's events fill in its id and token counts.
request_record: ContextVar[dict | None] = ContextVar("request_record", default=None)


class EngineBusy(Exception):
    """The waiting queue is full."""


class Engine:
    def __init__(
        self,
        model: str,
        scheduler_config: SchedulerConfig,
        max_queue: int = 256,
        vision_cache_size: int = 64,
        vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES,
        warm: bool = False,
        chat_template: str | None = None,
        parallel=None,
    ):
        self.model_name = model
        # This process's rank in a tensor-parallel group (vlm_serve.distributed.Rank):
        # it shards the model, and its scheduler leads or follows the group's turns.
        self.parallel = parallel
        self.chat_template = chat_template  # replaces the checkpoint's (--chat-template)
        self.warm = warm  # run every path once before reporting ready
        self.vision_cache_size = vision_cache_size
        self.vision_cache_bytes = vision_cache_bytes
        self.scheduler_config = scheduler_config
        self.max_queue = max_queue
        self.loaded: loader.LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlx-worker", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self.draining = False  # set on SIGTERM/SIGINT: the API refuses new requests
        self._aborted: str | None = None  # set by abort(): the error every request ends with

    # -- lifecycle (any thread) ---------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Start the worker thread and wait until the model is loaded."""
        self._thread.start()
        self._ready.wait(timeout)
        if self._load_error is not None:
            raise RuntimeError(f"could not start serving {self.model_name!r}") from self._load_error

    def wait(self) -> None:
        """Until the worker thread ends (a tensor-parallel follower's whole life)."""
        self._thread.join()

    def shutdown(self) -> None:
        if self.scheduler is not None and self._thread.is_alive():
            self.scheduler.inbox.put(Shutdown())
            self._thread.join(timeout=30)

    def abort(self, error: str) -> None:
        """End every request now with ``error``, and any submitted from now on."""
        self._aborted = error
        if self.scheduler is not None:
            self.scheduler.inbox.put(Abort(error))

    def _run(self) -> None:
        try:
            parallel = self.parallel
            # A rank loads lazily: only its own shard of the weights is materialised.
            self.loaded = loader.load(self.model_name, self.chat_template, lazy=parallel is not None)
            if parallel is not None:
                parallel.shard(self.loaded)  # before the family fuses the weights it decodes with
            weight_layout.lay_out(self.loaded.model)  # its own weights only, after any shard
            family = family_for(self.loaded.model, self.vision_cache_size, self.vision_cache_bytes)
            quantized_check.check(self.loaded.model)  # after the row-exact matmul is installed
            self.scheduler = (parallel.scheduler_class if parallel is not None else Scheduler)(
                self.loaded.model,
                family,
                self.loaded.tokenizer,
                self.loaded.detokenizer,
                self.loaded.eos_token_ids,
                self.loaded.vocab_size,
                self._publish,
                self.scheduler_config,
            )
            if parallel is not None:
                parallel.attach(self.scheduler, self.loaded)
            if self.warm:
                warm_up(self.loaded, self.scheduler)
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._load_error = exc
            self._forget_streams()  # else the process aborts at exit, after the error
            self._ready.set()
            return
        self._ready.set()
        try:
            self.scheduler.run()
        finally:
            self._release()

    @staticmethod
    def _forget_streams() -> None:
        import mlx.core as mx

        try:
            mx.synchronize()
        except Exception:  # noqa: BLE001 - a failed load may leave failed work behind
            pass
        mx.clear_streams()

    def _release(self) -> None:
        """Finish and free this thread's MLX work before it ends: MLX work or streams
        left on a thread that ends abort the process at exit with "terminate called
        without an active exception" (ml-explore/mlx#3126; mx.clear_streams is the
        cleanup MLX asks threads to do)."""
        import mlx.core as mx

        mx.synchronize()
        self.scheduler.release()
        if self.loaded is not None:
            self.loaded.model = None
        gc.collect()
        mx.clear_streams()

    def fail_now(self, error: str) -> None:
        """End every request at once with ``error``, from any thread, without the worker
        (a tensor-parallel group that failed may leave it stuck in a collective)."""
        self._aborted = error
        self.draining = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def end() -> None:
            for request_id, q in list(self._queues.items()):
                q.put_nowait(GenerationEvent(request_id, finish_reason=FinishReason.ERROR, error=error))
            self._queues.clear()

        loop.call_soon_threadsafe(end)

    # -- requests (event loop thread) ---------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    @property
    def memory(self) -> KVBudget:
        """The KV memory limit and what requests need under it (read-only after load)."""
        return self.scheduler.memory

    def submit(self, request: PreparedRequest) -> "RequestStream":
        return self.submit_copies([request])[0]

    def submit_copies(self, requests: list[PreparedRequest]) -> list["RequestStream"]:
        """Submit copies of one prompt (the n choices of a request; they differ only in
        id and seed): the prompt is prefilled once for all of them. Raises EngineBusy
        when the queue cannot take them all, KVBudgetExceeded when one copy could never
        fit the KV memory limit."""
        limit = self.scheduler_config.max_num_seqs + self.max_queue
        if self.in_flight + len(requests) > limit:
            raise EngineBusy(f"{self.in_flight} requests in flight")
        self.memory.check(requests[0])
        self._loop = asyncio.get_running_loop()
        record = request_record.get()
        if record is not None:
            record.update(request_id=requests[0].request_id, prompt_tokens=requests[0].num_prompt_tokens)
        streams = []
        for request in requests:
            q: asyncio.Queue = asyncio.Queue()
            if self._aborted is not None:
                # Shutting down: end it at once, the way the requests in flight ended.
                q.put_nowait(GenerationEvent(
                    request.request_id, finish_reason=FinishReason.CANCELLED, error=self._aborted,
                    prompt_tokens=request.num_prompt_tokens,
                ))
            else:
                self._queues[request.request_id] = q
            streams.append(RequestStream(self, request.request_id, q, record))
        if self._aborted is None:
            self.scheduler.inbox.put(Submit(requests[0], list(requests[1:])))
        return streams

    def cancel(self, request_id: str) -> None:
        if request_id in self._queues:
            self.scheduler.inbox.put(Cancel(request_id))

    def _publish(self, events: list[GenerationEvent]) -> None:
        # Worker thread: hand the whole step's events to the loop in one callback.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._dispatch, events)
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody is waiting for these events

    def _dispatch(self, events: list[GenerationEvent]) -> None:
        for event in events:
            q = self._queues.get(event.request_id)
            if q is None:
                continue
            q.put_nowait(event)
            if event.finished:
                del self._queues[event.request_id]


class RequestStream:
    """The events of one request, as an async iterator that ends after the final one.

    Leaving the iteration early (client gone, handler cancelled) cancels the request in
    the engine, so its row leaves the batch within a step.
    """

    def __init__(self, engine: Engine, request_id: str, q: asyncio.Queue, record: dict | None = None):
        self.engine = engine
        self.request_id = request_id
        self._queue = q
        self.finished = False
        self._record = record

    async def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        try:
            while True:
                event = _merge(await self._queue.get(), self._queue)
                if self._record is not None:
                    self._record["completion_tokens"] = event.completion_tokens
                yield event
                if event.finished:
                    self.finished = True
                    return
        finally:
            if not self.finished:
                self.engine.cancel(self.request_id)


def _merge(event: GenerationEvent, q: asyncio.Queue) -> GenerationEvent:
    """Fold events that queued up while the consumer was busy into one, so a slow
    consumer sends fewer, larger chunks instead of falling further behind."""
    while not event.finished and not q.empty():
        later = q.get_nowait()
        later.text = event.text + later.text
        later.token_ids = event.token_ids + later.token_ids
        later.logprobs = event.logprobs + later.logprobs
        event = later
    return event
