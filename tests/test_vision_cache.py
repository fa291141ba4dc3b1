"""The vision-feature cache's bounds: least recently used sets go first, its bytes never
pass the cap, a set larger than the cap is not kept, and a server whose cache is
bounded small serves exactly what an unbounded one does."""

from __future__ import annotations

import mlx.core as mx

from conftest import data_url, make_image
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
