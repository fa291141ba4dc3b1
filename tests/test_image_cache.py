"""The image cache: a resent image skips decoding and the image processor, yet every
request gets exactly what the model's processor gives for its images, and another
image, or the same images in another order, never shares an entry."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from mlx_vlm import load as vlm_load
from PIL import Image

from conftest import data_url, make_image
from vlm_serve.engine.loader import resolve_chat_template
from vlm_serve.engine.prefix_cache import prefix_key
from vlm_serve.engine.types import SamplingParams
from vlm_serve.fixtures.build import ARCHS, cached_model
from vlm_serve.preprocess import media
from vlm_serve.preprocess.image_cache import ImageCache
from vlm_serve.preprocess.media import MediaError, MediaPolicy, PixelBudget
from vlm_serve.preprocess.prompt import PromptContext, PromptError, load_chat_image, prepare_prompt, render_chat


def context(arch: str, cache: ImageCache | None, **policy) -> PromptContext:
    """A prompt context on its own freshly loaded processor."""
    path = cached_model(arch)
    _, processor = vlm_load(str(path))
    return PromptContext(processor, arch, MediaPolicy(**policy), 4,
                         resolve_chat_template(path, processor), image_cache=cache)


def prepare(ctx: PromptContext, urls: list[str], detail: str | None = None):
    """A one-turn chat with these images, loaded the way the chat route loads them."""
    content = [{"type": "image"}] * len(urls) + [{"type": "text", "text": "What is this?"}]
    prompt = render_chat(ctx, [{"role": "user", "content": content}])
    images = [load_chat_image(ctx, (u, "p", detail), None) for u in urls]
    return prepare_prompt(ctx, "r", prompt, SamplingParams(), images)


def assert_same_inputs(a, b) -> None:
    assert np.array_equal(a.input_ids, b.input_ids)
    assert a.model_inputs.keys() == b.model_inputs.keys()
    for key, value in a.model_inputs.items():
        other = b.model_inputs[key]
        pairs = zip(value, other) if isinstance(value, list) else [(value, other)]
        assert not isinstance(value, list) or len(value) == len(other), key
        for x, y in pairs:
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), key


# mlx-vlm's image processors of these return MLX arrays (or are called around the
# proxy, InternVL's), so only their loaded images are cached, not the processing.
LOADING_ONLY = {"kimi_vl", "internvl_chat", "phi3_v"}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_resent_image_is_served_from_the_cache_with_the_processors_own_output(arch):
    """Every family: the second request with the same images decodes nothing and (but
    for LOADING_ONLY) processes nothing, and both give exactly what an uncached
    context gives."""
    cache = ImageCache(16, 1 << 30)
    cached, plain = context(arch, cache), context(arch, None)
    urls = [data_url(make_image(64, 48, 1)), data_url(make_image(40, 72, 2), "JPEG")][: cached.max_images]
    first = prepare(cached, urls)
    hits = cache.hits
    second = prepare(cached, urls)
    assert cache.hits == hits + len(urls) + (arch not in LOADING_ONLY)  # images, processing
    expected = prepare(plain, urls)
    assert_same_inputs(first, expected)
    assert_same_inputs(second, expected)
    assert first.image_digests == second.image_digests


def test_cached_pixels_reach_the_request_without_a_round_trip_through_mlx():
    """mlx-vlm's Gemma 3 processor converts its outputs to MLX arrays: the cached pixels
    pass through it held, so every request with the image gets the cached array itself
    (read-only), not a copy made through MLX."""
    ctx = context("gemma3", ImageCache(16, 1 << 30))
    url = data_url(make_image(64, 48, 1))
    first, second = prepare(ctx, [url]), prepare(ctx, [url])
    pixels = first.model_inputs["pixel_values"]
    assert np.shares_memory(pixels, second.model_inputs["pixel_values"])
    assert not pixels.flags.writeable


def test_a_processor_that_refuses_held_pixels_gets_plain_ones(monkeypatch, caplog):
    """A processor that fails on a held array (none of the fixtures' does: a Gemma 3
    processor whose output conversion checks the pixels' type stands in for one) is
    handed plain arrays from then on, and the request still gets the processor's own
    output."""
    import mlx_vlm.models.gemma3.processing_gemma3 as gemma3_processing

    convert = gemma3_processing.to_mlx

    def picky(data):
        if not isinstance(data["pixel_values"], (list, np.ndarray)):
            raise TypeError("pixels must be a list or an array")
        return convert(data)

    monkeypatch.setattr(gemma3_processing, "to_mlx", picky)
    cache = ImageCache(16, 1 << 30)
    cached, plain = context("gemma3", cache), context("gemma3", None)
    url = data_url(make_image(64, 48, 1))
    assert cached.request_processor.image_processor.hand_over
    assert_same_inputs(prepare(cached, [url]), prepare(plain, [url]))
    assert not cached.request_processor.image_processor.hand_over
    assert "does not take held pixels" in caplog.text
    assert_same_inputs(prepare(cached, [url]), prepare(plain, [url]))


def test_a_request_the_processor_refuses_leaves_held_pixels_on():
    """A request whose inputs the processor refuses with plain pixels too is the
    request's fault: it gets a clear error, and held pixels stay on for the rest."""
    ctx = context("gemma3", ImageCache(16, 1 << 30))
    url = data_url(make_image(64, 48, 1))
    prompt = render_chat(ctx, [{"role": "user", "content": [{"type": "text", "text": "No image here."}]}])
    image = load_chat_image(ctx, (url, "p", None), None)
    with pytest.raises(PromptError, match="could not process the request's inputs"):
        prepare_prompt(ctx, "r", prompt, SamplingParams(), [image])  # an image, no placeholder
    assert ctx.request_processor.image_processor.hand_over


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_5_vl"])
def test_other_images_and_other_orders_never_share_entries(arch):
    """Each image set, in each order, with and without detail "low": what an uncached
    context gives, and a prefix-cache key of its own."""
    cache = ImageCache(64, 1 << 30)
    cached, plain = context(arch, cache), context(arch, None)
    a, b = data_url(make_image(96, 64, 3)), data_url(make_image(96, 64, 4))
    digests = {}
    for urls, detail in [([a], None), ([b], None), ([a, b], None), ([b, a], None), ([a, a], None),
                         ([a], "low"), ([a, b], None), ([b], None)]:
        got, expected = prepare(cached, urls, detail), prepare(plain, urls, detail)
        assert_same_inputs(got, expected)
        assert digests.setdefault((tuple(urls), detail), got.image_digests) == got.image_digests
    assert len(set(digests.values())) == len(digests)  # distinct requests, distinct keys
    # The same token ids with the images swapped: another prefix-cache key.
    ab, ba = prepare(cached, [a, b]), prepare(cached, [b, a])
    ids, image_tokens = ab.input_ids.tolist(), frozenset(np.setdiff1d(ab.input_ids, prepare(cached, []).input_ids).tolist())
    assert ids == ba.input_ids.tolist() and image_tokens
    assert prefix_key(ids, image_tokens, ab.image_digests) != prefix_key(ids, image_tokens, ba.image_digests)


def test_detail_low_is_keyed_apart(monkeypatch):
    monkeypatch.setattr(media, "LOW_DETAIL_SIZE", 48)
    cache = ImageCache(16, 1 << 30)
    cached, plain = context("qwen2_5_vl", cache), context("qwen2_5_vl", None)
    url = data_url(make_image(112, 112, 5))
    full, low = prepare(cached, [url]), prepare(cached, [url], "low")
    assert full.num_prompt_tokens > low.num_prompt_tokens
    assert full.image_digests != low.image_digests
    assert_same_inputs(low, prepare(plain, [url], "low"))
    assert_same_inputs(full, prepare(plain, [url]))


def test_the_same_image_sent_differently_is_still_right():
    """Another encoding of the same bytes (line breaks, no padding) or of the same
    pixels is another key, never a wrong entry."""
    cache = ImageCache(16, 1 << 30)
    cached, plain = context("gemma3", cache), context("gemma3", None)
    buf = io.BytesIO()
    make_image(64, 64, 6).save(buf, "PNG")
    text = base64.b64encode(buf.getvalue()).decode()
    variants = ["data:image/png;base64," + text,
                "data:image/png;base64," + "\n".join(text[i:i + 76] for i in range(0, len(text), 76)),
                "data:image/png;base64," + text.rstrip("=")]
    expected = prepare(plain, variants[:1])
    for url in variants:
        assert_same_inputs(prepare(cached, [url]), expected)


def test_the_pixel_budget_counts_cached_images_too():
    cache = ImageCache(16, 1 << 30)
    ctx = context("gemma3", cache)
    url = data_url(make_image(100, 100, 7))
    budget = PixelBudget(15_000)
    load_chat_image(ctx, (url, "p", None), budget)
    hits = cache.hits
    with pytest.raises(MediaError) as info:
        load_chat_image(ctx, (url, "p", None), budget)  # cached, but over the budget
    assert info.value.code == "image_too_large" and cache.hits == hits + 1


def test_the_cache_is_bounded_by_entries_and_bytes():
    cache = ImageCache(3, 1000)
    for i in range(10):
        cache.put(i, f"v{i}", 100)
    assert len(cache) == 3 and cache.bytes == 300
    assert [cache.get(i) for i in (7, 8, 9)] == ["v7", "v8", "v9"] and cache.get(6) is None
    cache.get(7)  # now the most recently used: 8 goes first
    cache.put(10, "v10", 100)
    assert cache.get(8) is None and cache.get(7) == "v7"
    cache.put("big", "b", 900)  # evicts the oldest until the bytes fit
    assert cache.bytes <= 1000 and cache.get("big") == "b" and len(cache) == 2
    cache.put("too-big", "x", 1001)  # larger than the whole budget: not kept, nothing evicted
    assert cache.get("too-big") is None and len(cache) == 2
    cache.put("big", "c", 100)  # replaced: its old size is given back
    assert cache.get("big") == "c" and cache.bytes == 200


def test_real_images_stay_within_the_byte_budget():
    """Loaded and processed 896 px images (the real Gemma 3 size) under a small budget."""
    one_image = 896 * 896 * 3
    cache = ImageCache(100, 4 * one_image)
    ctx = context("qwen2_5_vl", cache)
    for seed in range(6):
        image = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (896, 896, 3), np.uint8))
        prepare(ctx, [data_url(image)])
        assert 0 < cache.bytes <= 4 * one_image
    assert len(cache) < 12  # older images were evicted


def test_a_cache_of_size_zero_keeps_nothing():
    cache = ImageCache(0, 1 << 30)
    ctx = context("gemma3", cache)
    url = data_url(make_image(64, 48, 8))
    prepare(ctx, [url])
    prepare(ctx, [url])
    assert len(cache) == 0 and cache.hits == 0


# -- over HTTP ----------------------------------------------------------------------------


def image_part(image: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def conversation(*images: Image.Image) -> list[dict]:
    """Turn 2 of an image chat, as clients resend it."""
    return [{"role": "user", "content": [*map(image_part, images), {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": "It is a picture of something."},
            {"role": "user", "content": "Tell me more about it."}]


def chat(server, messages: list[dict]):
    return server.client().chat.completions.create(
        model=server.config.served_model_name, messages=messages, max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=3)


def test_over_http_a_resent_image_hits_and_a_swapped_one_gets_a_fresh_servers_answer(start_server):
    """The same conversation with another image, or its images in another order, on a
    server that has cached the first: exactly the answer of a server that caches
    nothing."""
    warm = start_server("gemma3")
    fresh = start_server("gemma3", image_cache_size=0, prefix_cache_size=0, vision_cache_size=0)
    cache = warm.app.state.vlm.prompt_context.image_cache
    a, b = make_image(56, 56, 11), make_image(56, 56, 12)
    chat(warm, conversation(a)[:1])
    hits = cache.hits
    turn_two = chat(warm, conversation(a))
    assert cache.hits == hits + 2  # the image, and its processing
    assert turn_two.usage.prompt_tokens_details.cached_tokens > 0
    answers = {"a": turn_two}
    expected = {"a": (a,), "b": (b,), "ab": (a, b), "ba": (b, a)}
    for name in ("b", "ab", "ba"):
        answers[name] = chat(warm, conversation(*expected[name]))
    fresh_answers = {name: chat(fresh, conversation(*images)) for name, images in expected.items()}
    for name, answer in answers.items():
        assert answer.choices[0].message.content == fresh_answers[name].choices[0].message.content, name
    # The images and their order do change the answer here (else this would prove
    # nothing): the first token's log-probabilities differ between all four.
    first = {tuple(t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs) for r in fresh_answers.values()}
    assert len(first) == 4


def test_large_sources_are_keyed_as_small_ones_are():
    """A source past a megabyte is hashed on several threads; its key is the same
    digest one thread gives (so it never depends on the machine), and one changed byte
    gives another key."""
    from vlm_serve.preprocess import image_cache

    source = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    assert len(source) >= image_cache._THREADED_HASH_BYTES
    key = image_cache.source_key("data-url", source, "fit")
    if image_cache._blake3 is not None:
        assert key == f"data-url:{image_cache._blake3(source).hexdigest()}:fit"
    changed = source[:-1] + bytes([source[-1] ^ 1])
    assert image_cache.source_key("data-url", changed, "fit") != key
    assert image_cache.source_key("data-url", source, "fit") == key


def test_over_http_turn_two_reuses_the_answer_too(start_server):
    """A client resends turn 1's answer with its next question: the answer's KV, kept
    when turn 1 finished, serves it too (the prompt tokens cached go past turn 1's
    prompt), and turn 2's answer is a fresh server's. Qwen2.5-VL: no sliding window, so
    a stored answer can be cut back to where a resent one parts from it."""
    warm = start_server("qwen2_5_vl")
    fresh = start_server("qwen2_5_vl", image_cache_size=0, prefix_cache_size=0, vision_cache_size=0)
    question = conversation(make_image(56, 56, 13))[:1]
    turn_one = chat(warm, question)
    messages = [*question, {"role": "assistant", "content": turn_one.choices[0].message.content},
                {"role": "user", "content": "Tell me more about it."}]
    turn_two = chat(warm, messages)
    assert turn_two.usage.prompt_tokens_details.cached_tokens > turn_one.usage.prompt_tokens
    assert turn_two.choices[0].message.content == chat(fresh, messages).choices[0].message.content
