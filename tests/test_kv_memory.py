"""The KV memory budget over real HTTP: requests that can never fit are refused with a
400 naming the limit, requests that do not fit yet wait (cached prefixes are evicted
first), the queue stays bounded, and under a small budget a burst of mixed requests
all finish with the tokens they get alone while what is held never passes the limit."""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from conftest import data_url, make_image, wait_until
from vlm_serve.engine.memory import format_bytes, parse_memory
from vlm_serve.engine.types import PreparedRequest, SamplingParams

MODEL = "tiny-gemma3"


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def prompt_tokens(server, messages) -> int:
    r = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "messages": messages})
    return r.json()["count"]


def sized(tokens: int, max_tokens: int) -> PreparedRequest:
    """A stand-in of a prepared text request of this size, for the budget's arithmetic."""
    return PreparedRequest("probe", np.zeros(tokens, np.int32), SamplingParams(max_tokens=max_tokens))


@pytest.fixture(scope="module")
def small(start_server):
    return start_server("gemma3", kv_cache_memory="300KiB", max_num_seqs=4, max_queue_size=8)


def test_limit_resolved_from_the_flag(small):
    assert small.engine.memory.limit == parse_memory("300KiB").bytes == 300 * 1024
    assert metric(small, "vlm_kv_memory_limit_bytes") == 300 * 1024


def test_a_request_that_can_never_fit_gets_400_naming_the_limit(small):
    client = small.client(max_retries=0)
    waits, prefills = small.scheduler.memory_waits, small.scheduler.prefills
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=user("hello"), max_tokens=2000)
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "kv_cache_memory_exceeded" and error["type"] == "invalid_request_error"
    assert error["param"] == "max_tokens"
    assert format_bytes(300 * 1024) in error["message"] and "--kv-cache-memory" in error["message"]
    # A prompt too large even for one token names the prompt; completions too.
    long_text = "word " * 1500
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=user(long_text), max_tokens=1)
    assert caught.value.response.json()["error"]["param"] == "messages"
    r = httpx.post(small.base_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(small.base_url + "/v1/completions", json={"prompt": long_text, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # Refused before it was queued: nothing waited, nothing was prefilled.
    assert small.scheduler.memory_waits == waits and small.scheduler.prefills == prefills
    assert small.engine.in_flight == 0


def test_a_default_max_tokens_is_lowered_to_what_fits(small):
    messages = user("tell me everything")
    budget = small.engine.memory
    p = prompt_tokens(small, messages)
    default = small.config.default_max_tokens
    assert budget.alone(sized(p, default)) > budget.limit  # the default would never fit
    r = small.client().chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == budget.fits_tokens(sized(p, default)) < default


def test_cached_prefixes_are_evicted_before_a_request_waits(start_server):
    server = start_server("gemma3", kv_cache_memory="440KiB", max_num_seqs=4)
    client = server.client()
    sch = server.scheduler
    client.chat.completions.create(model=MODEL, messages=user("the first prompt, kept " * 4),
                                   max_tokens=2, temperature=0)
    wait_until(lambda: not sch.running)  # its answer is kept as its row leaves
    held = sch.stats()
    # The prompt, and the prompt with its answer (past the fixture's sliding window the
    # longer one cannot be cut back to the shorter, so both are kept).
    assert held["prefix_cache_entries"] == 2 and held["prefix_cache_bytes"] > 0
    # A request that fits only with cached bytes given back: admitted at once, by evicting.
    messages = user("another prompt entirely")
    p = prompt_tokens(server, messages)
    m = next(m for m in range(1, 4000)
             if sch.memory.alone(sized(p, m)) + held["prefix_cache_bytes"] > sch.memory.limit)
    assert sch.memory.alone(sized(p, m)) <= sch.memory.limit
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=m,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == m
    wait_until(lambda: not sch.running)
    after = sch.stats()
    assert after["prefix_cache_evictions"] > held["prefix_cache_evictions"]
    assert after["kv_memory_waits"] == held["kv_memory_waits"] == 0
    assert after["kv_memory_peak"] <= sch.memory.limit


def test_an_answer_with_no_room_is_not_copied_out(start_server, monkeypatch):
    """A finished row's KV is copied out for the prefix cache only where the entry
    would be kept: with no room for prompt and answer, no copy is made (it would take
    memory beyond the budget only to be dropped); with room, it is."""
    from vlm_serve.engine.batch import Batch

    server = start_server("gemma3", max_num_seqs=2)
    sch = server.scheduler
    copies = []  # rows whose KV was copied out

    def row_cache(self, index, own=Batch.row_cache):
        copies.append(index)
        return own(self, index)

    monkeypatch.setattr(Batch, "row_cache", row_cache)

    def answer(words: str) -> None:
        r = server.client().chat.completions.create(model=MODEL, messages=user(words), max_tokens=64,
                                                    temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 64

    p = prompt_tokens(server, user("the prompt and its long answer"))
    sch.prefix_cache.max_bytes = sch.memory.layout.cache_bytes(p + 8)  # not 64 tokens more
    answer("the prompt and its long answer")
    assert copies == []
    sch.prefix_cache.max_bytes = 1 << 30  # room: the next answer is kept
    answer("another prompt and its answer")
    assert copies == [0]


def test_the_queue_stays_bounded_while_requests_wait_for_memory(start_server):
    server = start_server("gemma3", kv_cache_memory="1MiB", max_num_seqs=4, max_queue_size=8)
    sch = server.scheduler
    url = server.base_url + "/v1/chat/completions"
    # A long request holds most of the budget; short ones cannot fit beside it.
    long_body = {"messages": user("a long one"), "max_tokens": 1500, "ignore_eos": True,
                 "stream": True}
    short = {"messages": user("a short one"), "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    limit = server.config.max_num_seqs + server.config.max_queue_size
    release = threading.Event()

    def long_request() -> None:
        with httpx.stream("POST", url, json=long_body, timeout=120) as r:
            for _ in r.iter_lines():
                if release.is_set():
                    return  # the client leaves: the request is cancelled

    with concurrent.futures.ThreadPoolExecutor(limit) as pool:
        holder = pool.submit(long_request)
        wait_until(lambda: len(sch.running) == 1, timeout=60)
        futures = [pool.submit(httpx.post, url, json=short, timeout=120) for _ in range(limit - 1)]
        wait_until(lambda: server.engine.in_flight == limit, timeout=60)
        # Memory, not rows, holds them back, and the queue is full: 503.
        assert len(sch.running) == 1 < server.config.max_num_seqs
        assert sch.stats()["kv_memory_waits"] >= 1
        r = httpx.post(url, json=short)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"
        release.set()
        holder.result()
        results = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in results)
    assert len({r.json()["choices"][0]["message"]["content"] for r in results}) == 1
    assert sch.kv_memory_peak <= server.engine.memory.limit


def _soak_requests(model: str) -> list[dict]:
    """Mixed text and image requests of mixed lengths; every prompt comes back four
    times (i, i+6, ...), so the prefix cache fills."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
    out = []
    for i in range(24):
        text = " ".join(words[: 1 + i % 6]) * (1 + i % 3)
        content = text
        if i % 4 == 0:
            image = make_image(32 + 8 * (i % 3), 32, seed=i % 2)
            content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        out.append(dict(model=model, messages=user(content), max_tokens=8 + 7 * (i % 5), temperature=0))
    return out


# Gemma 3 decodes on the engine's slot store, Gemma 4 on mlx-lm's left-padded batch
# caches: the two ways the batch holds KV.
@pytest.mark.parametrize("arch,budget", [("gemma3", "600KiB"), ("gemma4", "500KiB")])
def test_soak_under_a_small_budget(start_server, arch, budget):
    server = start_server(arch, kv_cache_memory=budget, max_num_seqs=8, max_queue_size=64,
                          prefix_cache_size=8)
    sch, limit = server.scheduler, server.engine.memory.limit
    client = server.client(max_retries=0)
    requests = _soak_requests(f"tiny-{arch}")
    samples, stop = [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            s = sch.stats()
            samples.append((s["kv_memory_used"], s["kv_memory_reserved"], s["running"]))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda r: client.chat.completions.create(**r), requests))
    finally:
        stop.set()
        sampler.join()
    wait_until(lambda: not sch.running)
    stats = sch.stats()
    # The demand was over the budget: requests waited for memory, prefixes were evicted.
    assert stats["kv_memory_waits"] > 0
    assert stats["prefix_cache_evictions"] > 0
    assert metric(server, "vlm_prefix_cache_evictions_total") == stats["prefix_cache_evictions"]
    assert sch.peak_running > 1  # and still batched
    # What was held never passed the limit, whether sampled from outside or at each turn.
    assert samples and max(used for used, _, _ in samples) <= limit
    assert max(reserved for _, reserved, _ in samples) <= limit
    assert sch.kv_memory_peak <= limit
    assert 0 <= metric(server, "vllm:kv_cache_usage_perc") <= 1
    # Nothing lost: every request ends as it does served alone.
    alone = [client.chat.completions.create(**r) for r in requests]
    for i, (a, b) in enumerate(zip(together, alone)):
        assert a.choices[0].message.content == b.choices[0].message.content, i
        assert a.choices[0].finish_reason == b.choices[0].finish_reason
    # Idle again: only cached prefixes are held.
    assert stats["running"] == stats["waiting"] == 0
    assert stats["kv_memory_used"] == stats["prefix_cache_bytes"] <= limit
    print(f"soak {arch}: peak held {sch.kv_memory_peak} of {limit} bytes, {stats['kv_memory_waits']} waited, "
          f"{stats['prefix_cache_evictions']} evictions, {sch.peak_running} rows at most")


def test_the_flag_and_its_environment_variable():
    from vlm_serve.cli import parse_config

    assert parse_config(["--kv-cache-memory", "8GiB"]).kv_cache_memory == "8GiB"
    assert parse_config([], {"VLM_SERVE_KV_CACHE_MEMORY": "0.5"}).kv_cache_memory == "0.5"
    assert parse_config([]).kv_cache_memory is None
    for bad in (["--kv-cache-memory", "lots"], ["--kv-cache-memory", "0"]):
        with pytest.raises(SystemExit):
            parse_config(bad)
    with pytest.raises(SystemExit):
        parse_config([], {"VLM_SERVE_KV_CACHE_MEMORY": "8 parsecs"})
    assert parse_memory("512MiB").bytes == 512 << 20 and parse_memory("2GB").bytes == 2 * 10**9
    assert parse_memory("0.25").fraction == 0.25 and parse_memory("4096").bytes == 4096


def test_prefix_cache_evicts_the_least_recently_used_entry():
    """A hit makes its entry the most recently used: a shared prefix in use stays while
    an entry nobody asks for is evicted."""
    from mlx_lm.models.cache import KVCache

    from vlm_serve.engine.prefix_cache import PrefixCache

    def cache(n: int) -> list:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
        return [c]

    room = {"bytes": 1 << 30}
    prefixes = PrefixCache(2, 1 << 30, lambda: room["bytes"])
    prefixes.store([1, 2, 3], cache(3))
    prefixes.store([5, 6, 7], cache(3))
    assert prefixes.lookup([1, 2, 3, 4])[1] == 3  # used: now the most recent
    prefixes.store([9, 9, 9], cache(3))  # over two entries: the unused one goes
    assert prefixes.evictions == 1 and len(prefixes) == 2
    assert prefixes.lookup([5, 6, 7, 8])[1] == 0 and prefixes.lookup([1, 2, 3, 8])[1] == 3
    assert prefixes.queried_tokens == 12 and prefixes.reused_tokens == 6
    # The budget's room bounds it too: an entry larger than the room is not kept, and
    # shrinking the room evicts (least recently used first).
    room["bytes"] = prefixes.nbytes // 2 - 1  # less than one entry
    prefixes.store([4, 4, 4, 4], cache(4))
    assert len(prefixes) == 2
    prefixes.evict_to(prefixes.nbytes // 2)
    assert len(prefixes) == 1 and prefixes.lookup([1, 2, 3, 0])[1] == 3 and prefixes.evictions == 2


def test_a_prompts_prefill_need_is_worked_out_once_per_length(monkeypatch):
    """The scheduler sums every admitted request's prefill need whenever it measures
    its room (twice per finished prefill in a burst); the need depends only on the
    prompt's length and whether it has media, so the layout's per-layer arithmetic runs
    once per such pair, and gives what it gave before it was remembered."""
    from vlm_serve.engine.memory import KVBudget, KVLayout, LayerKV

    layout = KVLayout((LayerKV(64.0, None, 256), LayerKV(64.0, 32, 256)))
    budget = KVBudget(layout, 1 << 30, chunk=16, text_chunks=True, short_copies=True)
    calls = []
    real = KVLayout.prefill_bytes

    def counted(self, length, chunk):
        calls.append((length, chunk))
        return real(self, length, chunk)

    monkeypatch.setattr(KVLayout, "prefill_bytes", counted)
    text, image = sized(40, 8), sized(40, 8)
    image.num_images = 1
    for _ in range(3):
        assert budget.prefill_need(text) == 2 * real(layout, 40, 16)  # chunked, + short copy
        assert budget.prefill_need(image) == 2 * real(layout, 40, 40)  # whole prompt
        assert budget.prefill_need(sized(10, 8)) == real(layout, 10, 16)  # under the window
    assert sorted(calls) == [(10, 16), (40, 16), (40, 40)]


def test_a_stored_prefix_measures_the_room_once():
    """Storing a prefix asks the scheduler for its room (the admitted requests' demand)
    once, for both the check that the entry fits and the eviction after it."""
    from mlx_lm.models.cache import KVCache

    from vlm_serve.engine.prefix_cache import PrefixCache

    asked = []

    def room() -> int:
        asked.append(1)
        return 1 << 30

    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
    PrefixCache(4, 1 << 30, room).store([1, 2, 3], [c])
    assert len(asked) == 1


def test_prefix_cache_picks_the_entry_mlx_lm_would_pick():
    """The lookup reuses as many tokens as mlx-lm's own ``fetch_nearest_cache`` on the
    same entries (the same prompt, a longer one trimmed back, or the longest stored
    prefix), for random prompts that share prefixes of every length."""
    import random

    from mlx_lm.models.cache import KVCache, LRUPromptCache

    from vlm_serve.engine.prefix_cache import PrefixCache

    def cache(n: int) -> list:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)))
        return [c]

    rng = random.Random(3)
    for _ in range(20):
        base = [rng.randrange(5) for _ in range(12)]
        stored = [base[: rng.randrange(1, 12)] + [rng.randrange(5) for _ in range(rng.randrange(4))]
                  for _ in range(4)]
        ours, theirs = PrefixCache(16, 1 << 30), LRUPromptCache(max_size=16)
        for tokens in stored:
            ours.store(tokens, cache(len(tokens)))
            theirs.insert_cache("m", list(tokens), cache(len(tokens)))
        for _ in range(10):
            query = base[: rng.randrange(1, 13)] + [rng.randrange(5) for _ in range(rng.randrange(3))]
            found, rest = theirs.fetch_nearest_cache("m", query)
            expected = 0 if found is None else min(len(query) - len(rest), len(query) - 1)
            got_cache, got = ours.lookup(query)
            assert got == expected, (stored, query)
            if got:
                assert got_cache[0].offset == got


def test_prompts_reusing_one_prefix_get_caches_of_one_shape():
    """Two prompts that share the same 10 cached tokens, found through different stored
    prompts, get caches of the same shape (a sliding window that has not wrapped is cut
    to what it holds), so their prefill passes can be shared."""
    from mlx_lm.models.cache import RotatingKVCache

    from vlm_serve.engine.prefix_cache import PrefixCache

    def window(n: int) -> list:
        c = RotatingKVCache(max_size=32)
        c.update_and_fetch(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)))
        return [c]

    head = list(range(10))
    prefixes = PrefixCache(16, 1 << 30)
    prefixes.store(head + [50] * 10, window(20))
    prefixes.store(head + [60] * 15, window(25))
    first, n1 = prefixes.lookup(head + [50, 7, 7])
    second, n2 = prefixes.lookup(head + [60, 8, 8, 8])
    assert (n1, n2) == (11, 11)
    assert first[0].keys.shape == second[0].keys.shape and first[0].offset == second[0].offset


def test_a_lookup_of_at_most_n_tokens_gives_a_cache_of_n():
    """``reusable`` says what ``lookup`` will reuse without copying a cache; with
    ``at_most`` both stop there, and the cache holds just that many tokens, shaped as
    a prompt that shares only those would get it."""
    from mlx_lm.models.cache import RotatingKVCache

    from vlm_serve.engine.prefix_cache import PrefixCache

    def window(n: int) -> list:
        c = RotatingKVCache(max_size=32)
        c.update_and_fetch(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)))
        return [c]

    prefixes = PrefixCache(16, 1 << 30)
    prefixes.store(list(range(20)), window(20))
    query = list(range(14)) + [99, 99]
    assert prefixes.reusable(query) == 14 and prefixes.reusable(query, at_most=9) == 9
    assert prefixes.reused_tokens == 0  # nothing was taken
    cache, n = prefixes.lookup(query, at_most=9)
    alike, m = prefixes.lookup(list(range(9)) + [77])
    assert n == m == 9 == cache[0].offset
    assert cache[0].keys.shape == alike[0].keys.shape
    assert prefixes.reusable(query, at_most=30) == 14


def test_slot_buckets_are_every_slot_count_a_batch_can_take():
    """The warm-up decodes one batch per slot bucket: the list must be exactly the
    slot counts that 1..limit rows allocate."""
    from vlm_serve.engine.decode.store import slot_bucket, slot_buckets

    for limit in (1, 3, 12, 100, 300):
        assert slot_buckets(limit) == sorted({slot_bucket(rows) for rows in range(1, limit + 1)})


def _row_caches(n_rows: int, layers: int, length: int, seed: int) -> list[list]:
    """Per row, per layer, an mlx-lm cache holding ``length - row`` random keys/values."""
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    rows = []
    for row in range(n_rows):
        caches = []
        for _ in range(layers):
            cache = KVCache()
            k, v = (mx.random.normal((1, 2, length - row, 64)) for _ in range(2))
            cache.update_and_fetch(k, v)
            caches.append(cache)
        rows.append(caches)
    mx.eval([c.state for caches in rows for c in caches])
    return rows


def test_rows_join_with_one_update_per_layer_and_leave_without_moving():
    """A store's rows join with one update per layer (per run of free slots) and leave
    without moving anything: their slots are freed, and later rows join into them.
    Moving live rows into freed slots copied every layer whole (tens of ms on a GPU at
    128 rows); row by row, joining rows did too."""
    from vlm_serve.engine.decode.store import LayerKind, SlotStore

    layers, n_rows, length = 4, 32, 300
    store = SlotStore([LayerKind(None)] * layers, kv_heads=2, head_dim=64)
    rows = _row_caches(n_rows + 8, layers, length, seed=3)
    store.join(rows[:4])
    mx.eval(store.keys, store.values)

    before, joining = mx.get_active_memory(), 28 * layers * 2 * 2 * length * 64 * 4
    mx.reset_peak_memory()
    store.join(rows[4:n_rows])  # one store's worth of fresh arrays, then the update in place
    mx.eval(store.keys, store.values)
    assert mx.get_peak_memory() - before <= 1.2 * store.nbytes + 2.5 * joining  # rows padded, stacked

    before = mx.get_active_memory()
    mx.reset_peak_memory()
    kept = list(range(0, n_rows, 2))
    store.keep(kept)  # 16 leave; the rest keep their order and slots
    mx.eval(store.keys, store.values)
    assert mx.get_peak_memory() - before <= 0.05 * store.nbytes
    assert store.slot_of == kept and store.slots == n_rows

    store.join(rows[n_rows:])  # 8 rows take the first 8 freed slots
    assert store.slot_of == kept + list(range(1, 16, 2))
    sources = kept + list(range(n_rows, n_rows + 8))  # row i holds rows[sources[i]]
    assert store.lengths == [length - source for source in sources]
    for slot, source in zip(store.slot_of, sources):
        held = length - source
        for layer in range(layers):
            assert mx.array_equal(store.keys[layer][slot, :, :held], rows[source][layer].keys[0, :, :held]).item()
            assert mx.array_equal(store.values[layer][slot, :, :held], rows[source][layer].values[0, :, :held]).item()

    store.keep(list(range(4)))  # a quarter of the slots in use: compacted into a smaller store
    assert store.slots == 4 and store.slot_of == [0, 1, 2, 3]
    for slot, source in enumerate(sources[:4]):
        held = length - source
        assert mx.array_equal(store.keys[0][slot, :, :held], rows[source][0].keys[0, :, :held]).item()


def test_freed_buffers_kept_by_mlx_are_capped_under_the_devices_share(monkeypatch):
    """MLX's cache of freed buffers is capped so that it, the weights and the KV that
    admitted requests reserve stay under ``BUFFER_CACHE_CEILING`` of the device (at
    least ``MIN_BUFFER_CACHE``); idle, under what the whole KV limit leaves. (The device's
    size is made up, so the arithmetic reads in round numbers.)"""
    from vlm_serve.engine import memory
    from vlm_serve.engine.memory import BUFFER_CACHE_CEILING, MIN_BUFFER_CACHE, BufferCacheBound

    gib = 1 << 30
    monkeypatch.setattr(memory, "device_memory", lambda: (100 * gib, "a test device"))
    monkeypatch.setattr(memory, "weights_bytes", lambda model: 8 * gib)
    room = int(BUFFER_CACHE_CEILING * 100 * gib) - 8 * gib
    previous = mx.set_cache_limit(0)
    try:
        bound = BufferCacheBound(50 * gib, model=None, moving=True)
        assert bound.idle_cap == room - 50 * gib
        assert mx.set_cache_limit(bound.idle_cap) == bound.idle_cap  # what MLX was given
        assert bound.busy(10 * gib) == room - 10 * gib
        assert mx.set_cache_limit(bound.cap) == room - 10 * gib
        assert bound.busy(90 * gib) == MIN_BUFFER_CACHE
        assert bound.idle() == room - 50 * gib
        assert BufferCacheBound(90 * gib, model=None).idle_cap == MIN_BUFFER_CACHE
        fixed = BufferCacheBound(50 * gib, model=None, moving=False)
        assert fixed.busy(10 * gib) == fixed.idle_cap  # the CPU's and Apple silicon's default
    finally:
        mx.set_cache_limit(previous)


def test_a_nearly_full_buffer_cache_is_trimmed_and_an_idle_one_let_go(monkeypatch):
    """A cache at ``TRIM_AT`` of its cap is capped at half for a turn, so MLX frees its
    least recently used buffers and caches what is freed next (a full cache caches
    nothing); the next turn has the whole cap again. An idle server lets go of what is
    over its idle cap. Real buffers on this machine's MLX, a made-up device size."""
    from vlm_serve.engine import memory
    from vlm_serve.engine.memory import BufferCacheBound

    mib = 1 << 20
    monkeypatch.setattr(memory, "MIN_BUFFER_CACHE", 64 * mib)
    monkeypatch.setattr(memory, "device_memory", lambda: (1000 * mib, "a test device"))
    monkeypatch.setattr(memory, "weights_bytes", lambda model: 0)
    previous = mx.set_cache_limit(0)
    mx.clear_cache()
    try:
        bound = BufferCacheBound(836 * mib, model=None, moving=True)  # idle: 900 - 836 = 64 MiB
        bound.busy(800 * mib)  # a cap of 100 MiB
        assert bound.cap == 100 * mib
        buffers = [mx.ones((mib // 4,)) for _ in range(95)]  # 95 buffers of 1 MiB
        mx.eval(buffers)
        del buffers
        assert mx.get_cache_memory() >= 90 * mib
        assert bound.busy(800 * mib) == 50 * mib and bound.trims == 1
        mx.eval(mx.ones((mib // 4,)))  # an allocation: MLX keeps the cache under the cap
        assert mx.get_cache_memory() <= 50 * mib
        assert bound.busy(800 * mib) == 100 * mib
        buffers = [mx.ones((mib // 4,)) for _ in range(80)]
        mx.eval(buffers)
        del buffers
        assert mx.get_cache_memory() > 64 * mib
        bound.idle()
        assert mx.get_cache_memory() <= 64 * mib and bound.cap == 64 * mib
    finally:
        mx.set_cache_limit(previous)
        mx.clear_cache()


def test_the_buffer_cache_cap_follows_the_reservations_and_returns_when_idle(start_server, monkeypatch):
    """While a request is served the cap is the room its reservation leaves, above the
    idle cap; once the server is idle again, the idle cap. (CUDA's default, asked for
    here by name: the CPU keeps the idle cap.)"""
    monkeypatch.setenv("VLM_SERVE_BUFFER_CACHE", "moving")
    server = start_server("gemma3", max_num_seqs=2)
    bound = server.scheduler.buffer_cache
    stream = server.client().chat.completions.create(
        model=MODEL, messages=user("count with me"), max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    caps = [bound.cap for _ in stream]
    assert bound.idle_cap < max(caps) < bound.room  # the room less a reservation
    wait_until(lambda: bound.cap == bound.idle_cap)


def test_a_prefix_shorter_than_the_minimum_is_prefilled_again():
    """With ``min_reuse`` (``--prefix-cache-min-tokens``), a stored prefix shorter than it
    is neither counted as reusable nor copied; one at least that long is."""
    from mlx_lm.models.cache import KVCache

    from vlm_serve.cli import parse_config
    from vlm_serve.engine.prefix_cache import PrefixCache

    def cache(n: int) -> list:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
        return [c]

    prefixes = PrefixCache(4, 1 << 30, min_reuse=4)
    prefixes.store([1, 2, 3], cache(3))
    prefixes.store([5, 6, 7, 8, 9], cache(5))
    assert prefixes.reusable([1, 2, 3, 4, 0]) == 0 and prefixes.lookup([1, 2, 3, 4, 0]) == (None, 0)
    assert prefixes.reusable([5, 6, 7, 8, 0]) == 4
    found, reused = prefixes.lookup([5, 6, 7, 8, 0])
    assert reused == 4 and found[0].offset == 4
    assert prefixes.reused_tokens == 4
    assert parse_config(["--prefix-cache-min-tokens", "32"]).prefix_cache_min_tokens == 32
    assert parse_config([]).prefix_cache_min_tokens is None
    with pytest.raises(SystemExit):
        parse_config(["--prefix-cache-min-tokens", "0"])
