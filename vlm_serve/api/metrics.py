"""Prometheus metrics under vLLM's names, so dashboards and alerts made for vLLM work.

Every series carries a ``model_name`` label, as vLLM's do. What vLLM has no name for
keeps a ``vlm_`` name: requests by outcome (rejections included), KV memory in bytes
and its limit, the prefix cache's size and evictions, the vision-feature and image
caches' size, limit, hits and evictions, prefills. No ``_created`` series
(prometheus_client's per-series creation timestamps double the scrape and nothing reads
them).

Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from prometheus_client import (
    CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from ..engine.scheduler import SLOW_TURN_LOG_S, SLOW_TURN_S
from ..engine.types import GenerationEvent
from ..lru import SizedLRU

disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
# Our finish reasons as vLLM reports them in request_success_total's finished_reason.
_VLLM_REASON = {"cancelled": "abort"}


class Metrics:
    def __init__(self, scheduler_stats, model_name: str, image_cache: SizedLRU | None = None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def labelled(metric):
            return metric.labels(model_name)

        self._outcomes = Counter("vlm_requests", "Requests by outcome: a finish reason, "
                                 "cancelled, or rejected_<status>", ["model_name", "outcome"], registry=r)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = labelled(Counter("vllm:prompt_tokens", "Prompt tokens processed", m, registry=r))
        self.generation_tokens = labelled(Counter("vllm:generation_tokens", "Tokens generated", m, registry=r))
        self.ttft = labelled(Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                       m, buckets=_LATENCY_BUCKETS, registry=r))
        self.itl = labelled(Histogram("vllm:inter_token_latency_seconds", "Time between streamed tokens",
                                      m, buckets=_ITL_BUCKETS, registry=r))
        self.e2e = labelled(Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish",
                                      m, buckets=_LATENCY_BUCKETS, registry=r))
        r.register(_EngineCollector(scheduler_stats, model_name, image_cache))

    def rejected(self, status: int) -> None:
        self._outcomes.labels(self.model_name, f"rejected_{status}").inc()

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
            outcome = final.finish_reason.value if finished else "cancelled"
            self._outcomes.labels(self.model_name, outcome).inc()
            self._success.labels(self.model_name, _VLLM_REASON.get(outcome, outcome)).inc()
            if final is not None:
                self.prompt_tokens.inc(final.prompt_tokens)
                self.generation_tokens.inc(final.completion_tokens)
            self.e2e.observe(time.monotonic() - arrived)

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _EngineCollector:
    """Gauges and running totals read from the scheduler, and from the API side's image
    cache, at scrape time."""

    def __init__(self, scheduler_stats, model_name: str, image_cache: SizedLRU | None = None):
        self.stats = scheduler_stats
        self.model_name = model_name
        self.image_cache = image_cache

    def collect(self):
        s = self.stats()
        images = self.image_cache
        if images is not None:
            s.update(image_cache_entries=len(images), image_cache_bytes=images.bytes,
                     image_cache_limit=images.max_bytes, image_cache_hits=images.hits,
                     image_cache_evictions=images.evictions)
        limit = s.get("kv_memory_limit", 0)
        s["kv_memory_usage"] = s.get("kv_memory_used", 0) / limit if limit else 0.0
        for kind, name, doc, key in (
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the decode batch", "running"),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting or in prefill", "waiting"),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV memory in use as a fraction of its "
             "limit (1 means full)", "kv_memory_usage"),
            (GaugeMetricFamily, "vlm_kv_cache_bytes", "Bytes held by the batch KV cache", "kv_cache_bytes"),
            (GaugeMetricFamily, "vlm_kv_memory_used_bytes", "KV bytes held now: the batch, prompts "
             "in prefill and cached prefixes", "kv_memory_used"),
            (GaugeMetricFamily, "vlm_kv_memory_reserved_bytes", "KV bytes the admitted requests may "
             "come to hold, cached prefixes included", "kv_memory_reserved"),
            (GaugeMetricFamily, "vlm_kv_memory_limit_bytes", "The KV memory limit "
             "(--kv-cache-memory)", "kv_memory_limit"),
            (CounterMetricFamily, "vlm_kv_memory_waits", "Requests that waited in the queue for KV "
             "memory", "kv_memory_waits"),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the "
             "prefix cache", "prefix_cache_queried_tokens"),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens whose KV came from the "
             "prefix cache", "prefix_cache_hit_tokens"),
            (GaugeMetricFamily, "vlm_prefix_cache_bytes", "KV bytes held by cached prefixes",
             "prefix_cache_bytes"),
            (GaugeMetricFamily, "vlm_prefix_cache_entries", "Prompts whose KV the prefix cache "
             "holds", "prefix_cache_entries"),
            (CounterMetricFamily, "vlm_prefix_cache_evictions", "Cached prefixes evicted to make "
             "room", "prefix_cache_evictions"),
            (CounterMetricFamily, "vlm_prefills", "Prompts prefilled (the n copies of one "
             "prompt count once)", "prefills"),
            (CounterMetricFamily, "vlm_slow_turns", "Scheduler turns that held the running "
             f"streams up for over {SLOW_TURN_S * 1000:g} ms (logged with their parts, at most "
             f"one every {SLOW_TURN_LOG_S:g} s)", "slow_turns"),
            (CounterMetricFamily, "vlm_vision_cache_hits", "Requests whose image features came "
             "from the vision cache", "vision_cache_hits"),
            (GaugeMetricFamily, "vlm_vision_cache_entries", "Image sets whose vision features "
             "the vision cache holds", "vision_cache_entries"),
            (GaugeMetricFamily, "vlm_vision_cache_bytes", "Bytes of the vision features the vision "
             "cache holds", "vision_cache_bytes"),
            (GaugeMetricFamily, "vlm_vision_cache_limit_bytes", "The vision cache's byte limit "
             "(--vision-cache-gb)", "vision_cache_limit"),
            (CounterMetricFamily, "vlm_vision_cache_evictions", "Image sets' vision features "
             "evicted to make room", "vision_cache_evictions"),
            (GaugeMetricFamily, "vlm_image_cache_entries", "Entries the image cache holds: a "
             "decoded image, or one request's processed images", "image_cache_entries"),
            (GaugeMetricFamily, "vlm_image_cache_bytes", "Bytes of the decoded and processed "
             "images the image cache holds", "image_cache_bytes"),
            (GaugeMetricFamily, "vlm_image_cache_limit_bytes", "The image cache's byte limit "
             "(--image-cache-gb)", "image_cache_limit"),
            (CounterMetricFamily, "vlm_image_cache_hits", "Lookups answered by the image cache "
             "(a decoded image, or a request's processed images)", "image_cache_hits"),
            (CounterMetricFamily, "vlm_image_cache_evictions", "Image cache entries evicted to "
             "make room", "image_cache_evictions"),
        ):
            family = kind(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], s.get(key, 0))
            yield family


async def metrics_endpoint(request: Request) -> Response:
    return request.app.state.vlm.metrics.response()
