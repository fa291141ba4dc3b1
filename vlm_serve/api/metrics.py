"""Prometheus metrics: requests by outcome, tokens, latencies, queue and cache gauges.

Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from ..engine.types import GenerationEvent

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class Metrics:
    def __init__(self, scheduler_stats):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vlm_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("vlm_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("vlm_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("vlm_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vlm_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vlm_e2e_request_latency_seconds", "Request latency, arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        running = Gauge("vlm_num_requests_running", "Requests in the decode batch", registry=r)
        waiting = Gauge("vlm_num_requests_waiting", "Requests waiting or in prefill", registry=r)
        kv_bytes = Gauge("vlm_kv_cache_bytes", "Bytes held by the batch KV cache", registry=r)
        running.set_function(lambda: scheduler_stats()["running"])
        waiting.set_function(lambda: scheduler_stats()["waiting"])
        kv_bytes.set_function(lambda: scheduler_stats()["kv_cache_bytes"])

    async def observe(self, events: AsyncIterator[GenerationEvent], arrived: float):
        """Pass events through, recording token counts and latencies."""
        last = None
        final = None
        try:
            async for event in events:
                now = time.monotonic()
                if event.token_ids:
                    if last is None:
                        self.ttft.observe(now - arrived)
                    else:
                        self.itl.observe((now - last) / len(event.token_ids))
                    last = now
                final = event
                yield event
        finally:
            # A client that left before the end shows up as cancelled.
            finished = final is not None and final.finished
            self.requests.labels(final.finish_reason.value if finished else "cancelled").inc()
            if final is not None:
                self.prompt_tokens.inc(final.prompt_tokens)
                self.generation_tokens.inc(final.completion_tokens)
            self.e2e.observe(time.monotonic() - arrived)

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


async def metrics_endpoint(request: Request) -> Response:
    return request.app.state.vlm.metrics.response()
