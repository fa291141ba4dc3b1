"""The vision-feature cache's bounds: least recently used sets go first, its bytes never
pass the cap, a set larger than the cap is not kept, families build it with both bounds,
a server whose cache is bounded small serves exactly what an unbounded one does, and
/metrics shows it and the image cache as they fill, hit and evict."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import mlx.core as mx
from prometheus_client.parser import text_string_to_metric_families

from conftest import data_url, make_image
from vlm_serve.engine.families import FAMILIES, SerialFamily, family_for
from vlm_serve.engine.vision_cache import VisionCache, features_bytes
from vlm_serve.lru import SizedLRU


def test_least_recently_used_entries_go_first_and_bytes_stay_under_the_cap():
    lru = SizedLRU(max_entries=10, max_bytes=100)
    for key in "abc":
        lru.put(key, key.upper(), 30)
    assert lru.get("a") == "A"  # now b is the least recently used
    lru.put("d", "D", 30)
    assert lru.get("b") is None and [lru.get(k) for k in "acd"] == ["A", "C", "D"]
    assert lru.bytes == 90 and lru.evictions == 1
    lru.put("e", "E", 70)  # a then c (least recently used first) make room; d fits beside
    assert [lru.get(k) for k in "acde"] == [None, None, "D", "E"]
    assert lru.bytes == 100 and lru.evictions == 3
    for i in range(50):
        lru.put(i, i, 1 + i % 40)
        assert lru.bytes <= lru.max_bytes and len(lru) <= lru.max_entries
        assert lru.bytes == sum(size for _, size in lru._entries.values())


def test_an_entry_larger_than_the_cap_is_not_kept_and_evicts_nothing():
    lru = SizedLRU(max_entries=10, max_bytes=100)
    lru.put("small", 1, 60)
    lru.put("huge", 2, 101)
    assert lru.get("huge") is None and lru.get("small") == 1
    assert lru.bytes == 60 and lru.evictions == 0


def test_replacing_a_key_counts_its_bytes_once():
    lru = SizedLRU(max_entries=2, max_bytes=100)
    lru.put("a", 1, 40)
    lru.put("a", 2, 50)
    assert lru.get("a") == 2 and lru.bytes == 50 and len(lru) == 1


def test_the_entry_bound_still_holds():
    lru = SizedLRU(max_entries=2, max_bytes=1 << 30)
    for key in "abc":
        lru.put(key, key, 1)
    assert lru.get("a") is None and len(lru) == 2


def test_vision_cache_sizes_features_by_their_arrays():
    one = mx.zeros((1, 4, 8), mx.float32)  # 128 bytes
    pair = (mx.zeros((1, 4, 8), mx.float16), mx.zeros((2,), mx.int32))  # 64 + 8
    assert features_bytes(one) == 128 and features_bytes(pair) == 72
    cache = VisionCache(size=8, max_bytes=200)
    cache.put(("a",), one)
    cache.put(("b",), pair)
    assert cache.bytes == 200
    cache.put(("c",), pair)  # a goes
    assert cache.get(("a",)) is None and cache.get(("b",)) is pair
    assert cache.bytes == 144 and cache.evictions == 1 and cache.hits == 1
    cache.put(("big",), mx.zeros((64,), mx.float32))  # 256 bytes: over the cap
    assert cache.get(("big",)) is None and cache.bytes == 144
    off = VisionCache(size=0)
    off.put(("a",), one)
    assert off.get(("a",)) is None and off.bytes == 0


def test_families_build_their_vision_cache_with_both_bounds():
    class Probe:  # what the families' constructors read (an unknown text model)
        def __init__(self, model_type):
            self.config = SimpleNamespace(model_type=model_type)
            self.vision_tower = object()
            self.language_model = SimpleNamespace(model=object(), config=SimpleNamespace())

    for model_type in [*FAMILIES, "brand_new_vlm"]:
        family = family_for(Probe(model_type), 3, 12345)
        assert (family.vision_cache.size, family.vision_cache.max_bytes) == (3, 12345), model_type
    assert isinstance(family, SerialFamily)


# Image sets in the order a few conversations send them; the same set comes back after
# others pushed it out of a cache that holds one.
IMAGES = [make_image(40, 30, 1), make_image(30, 50, 2), make_image(44, 44, 3)]
SETS = [(0,), (1,), (0,), (0, 1), (2,), (1,), (0,), (0, 1), (2,), (2,)]


def _answers(server) -> list[str]:
    client = server.client()
    answers = []
    for i, images in enumerate(SETS):
        parts = [{"type": "image_url", "image_url": {"url": data_url(IMAGES[j])}} for j in images]
        parts.append({"type": "text", "text": f"Turn {i}: what is this?"})
        stream = client.chat.completions.create(
            model=server.config.served_model_name, messages=[{"role": "user", "content": parts}],
            temperature=0, max_tokens=8, stream=True,
        )
        answers.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return answers


def test_a_small_vision_cache_serves_what_an_unbounded_one_does(start_server):
    # No prefix cache: every request must reach the vision cache.
    unbounded = start_server("gemma3", prefix_cache_size=0)
    expected = _answers(unbounded)
    big = unbounded.scheduler.family.vision_cache
    assert big.hits >= 5 and big.evictions == 0
    one_image = big.bytes / 5  # three single images and a pair, all images the same size
    unbounded.stop()

    # Room for one single image's features: a pair never fits, a single pushes out the last.
    bounded = start_server("gemma3", prefix_cache_size=0, vision_cache_gb=1.5 * one_image / 2**30)
    assert _answers(bounded) == expected
    small = bounded.scheduler.family.vision_cache
    assert small.evictions > 0 and 0 < small.bytes <= small.max_bytes and len(small) == 1
    assert small.hits >= 1  # (2,) twice in a row


def _scrape(server) -> dict[str, float]:
    """/metrics as {sample name: value} (counters under their ``_total`` names)."""
    text = httpx.get(server.base_url + "/metrics").text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.labels.get("model_name") == "tiny-gemma3"}


def _ask(server, image) -> None:
    server.client().chat.completions.create(
        model=server.config.served_model_name, temperature=0, max_tokens=2,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": "what is this?"}]}],
    )


def test_metrics_show_both_media_caches_filling_hitting_and_evicting(start_server):
    # No prefix cache: every image request reaches the vision cache.
    server = start_server("gemma3", prefix_cache_size=0)
    m = _scrape(server)
    assert m["vlm_vision_cache_limit_bytes"] == 2**30  # the default --vision-cache-gb
    assert m["vlm_image_cache_limit_bytes"] == 2**30
    assert m["vlm_vision_cache_bytes"] == m["vlm_vision_cache_entries"] == 0

    _ask(server, IMAGES[0])
    first = _scrape(server)
    one_image = first["vlm_vision_cache_bytes"]
    assert one_image > 0 and first["vlm_vision_cache_entries"] == 1
    assert first["vlm_image_cache_bytes"] > 0 and first["vlm_image_cache_entries"] >= 1
    _ask(server, IMAGES[1])  # a new image: its features are added
    second = _scrape(server)
    assert second["vlm_vision_cache_bytes"] > one_image and second["vlm_vision_cache_entries"] == 2
    _ask(server, IMAGES[0])  # resent: both caches answer, nothing grows
    again = _scrape(server)
    assert again["vlm_image_cache_hits_total"] > second["vlm_image_cache_hits_total"]
    assert again["vlm_vision_cache_hits_total"] == second["vlm_vision_cache_hits_total"] + 1
    assert again["vlm_vision_cache_bytes"] == second["vlm_vision_cache_bytes"]
    assert again["vlm_image_cache_bytes"] == second["vlm_image_cache_bytes"]
    assert again["vlm_vision_cache_evictions_total"] == again["vlm_image_cache_evictions_total"] == 0
    server.stop()

    # Room for one image's features (all three give the same number of tokens), and
    # for two image cache entries (an image's decoded and processed forms).
    gb = 1.5 * one_image / 2**30
    small = start_server("gemma3", prefix_cache_size=0, vision_cache_gb=gb, image_cache_size=2)
    limit = _scrape(small)["vlm_vision_cache_limit_bytes"]
    assert limit == int(gb * 2**30) and one_image <= limit < 2 * one_image
    evictions = []
    for image in IMAGES:
        _ask(small, image)
        m = _scrape(small)
        assert m["vlm_vision_cache_bytes"] == one_image <= limit  # the new image, alone
        assert m["vlm_vision_cache_entries"] == 1 and m["vlm_image_cache_entries"] <= 2
        evictions.append((m["vlm_vision_cache_evictions_total"], m["vlm_image_cache_evictions_total"]))
    assert [v for v, _ in evictions] == [0, 1, 2]
    assert evictions[0][1] < evictions[1][1] < evictions[2][1]
