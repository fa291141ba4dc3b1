"""Per-row sampling and incremental text, with the real fixture tokenizer."""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm import load as vlm_load

from vlm_serve.engine.detokenize import TextAssembler, make_detokenizer
from vlm_serve.engine.sampling import BatchSampler, top_logprobs
from vlm_serve.engine.types import SamplingParams

V = 50


def logits_batch(seed: int, rows: int) -> mx.array:
    return mx.random.normal((rows, V), key=mx.random.key(seed))


def test_greedy_rows_take_argmax_beside_sampled_rows():
    s = BatchSampler(V)
    s.add(SamplingParams(temperature=0.0), [])
    s.add(SamplingParams(temperature=1.0, top_k=3), [])
    s.add(SamplingParams(temperature=0.0), [])
    logits = logits_batch(0, 3)
    tokens = s.sample(logits).tokens.tolist()
    best = mx.argmax(logits, axis=-1).tolist()
    assert tokens[0] == best[0] and tokens[2] == best[2]
    top3 = mx.argsort(-logits[1])[:3].tolist()
    assert tokens[1] in top3


def test_top_k_one_and_tiny_top_p_are_greedy():
    s = BatchSampler(V)
    s.add(SamplingParams(temperature=1.5, top_k=1), [])
    s.add(SamplingParams(temperature=1.5, top_p=1e-6), [])
    for seed in range(5):
        logits = logits_batch(seed, 2)
        assert s.sample(logits).tokens.tolist() == mx.argmax(logits, axis=-1).tolist()


def test_min_p_keeps_only_likely_tokens():
    s = BatchSampler(V)
    s.add(SamplingParams(temperature=1.0, min_p=0.5), [])
    logits = mx.full((1, V), -10.0)
    logits = logits.at[0, 7].add(20.0).at[0, 9].add(19.8)  # 7 and 9 close; the rest far
    seen = {s.sample(logits).tokens.item() for _ in range(40)}
    assert seen <= {7, 9} and 7 in seen


def test_logit_bias_forces_and_bans_tokens():
    s = BatchSampler(V)
    s.add(SamplingParams(temperature=0.0, logit_bias={11: 100.0}), [])
    s.add(SamplingParams(temperature=0.0), [])
    logits = logits_batch(1, 2)
    banned = int(mx.argmax(logits[1]).item())
    s.add(SamplingParams(temperature=0.0, logit_bias={banned: -100.0}), [])
    tokens = s.sample(mx.concatenate([logits, logits[1:]])).tokens.tolist()
    assert tokens[0] == 11
    assert tokens[1] == banned  # the unbiased row is untouched
    assert tokens[2] != banned


def test_penalties_discourage_repeats_per_row():
    s = BatchSampler(V)
    s.add(SamplingParams(temperature=0.0, frequency_penalty=2.0), [])
    s.add(SamplingParams(temperature=0.0), [])
    logits = mx.zeros((2, V)).at[:, 5].add(1.0).at[:, 6].add(0.5)
    first = s.sample(logits).tokens.tolist()
    second = s.sample(logits).tokens.tolist()
    assert first == [5, 5]
    assert second == [6, 5]  # only the penalised row moves off token 5


def test_repetition_penalty_counts_prompt_tokens():
    s = BatchSampler(V)
    s.add(SamplingParams(temperature=0.0, repetition_penalty=4.0), [5])
    logits = mx.zeros((1, V)).at[:, 5].add(1.0).at[:, 6].add(0.5)
    assert s.sample(logits).tokens.item() == 6


def test_rows_leave_and_join_keep_their_settings():
    a, b = BatchSampler(V), BatchSampler(V)
    a.add(SamplingParams(temperature=0.0, logit_bias={3: 100.0}), [])
    a.add(SamplingParams(temperature=0.0), [])
    b.add(SamplingParams(temperature=0.0, logit_bias={4: 100.0}), [])
    a.keep([0])
    a.extend(b)
    tokens = a.sample(logits_batch(2, 2)).tokens.tolist()
    assert tokens == [3, 4]


def test_top_logprobs_are_sorted_and_include_chosen():
    logprobs = mx.log(mx.softmax(logits_batch(3, 2), axis=-1))
    tokens = mx.argmax(logprobs, axis=-1)
    chosen, ids, vals = top_logprobs(logprobs, tokens, 4)
    assert ids.shape == (2, 4)
    assert ids[:, 0].tolist() == tokens.tolist()
    assert mx.allclose(chosen, vals[:, 0]).item()
    assert (vals[:, :-1] >= vals[:, 1:]).all().item()


def _tokenizer_and_detok(model_path):
    path = model_path("gemma3")
    _, processor = vlm_load(str(path))
    tokenizer = processor.tokenizer
    return tokenizer, make_detokenizer(path, tokenizer)


def test_streaming_text_keeps_multibyte_characters_whole(model_path):
    tokenizer, detok = _tokenizer_and_detok(model_path)
    text = "héllo 世界 🙂 naïve café — ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assembler = TextAssembler(detok, [])
    pieces = [assembler.add_token(t) for t in ids] + [assembler.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_across_tokens_is_never_emitted(model_path):
    tokenizer, detok = _tokenizer_and_detok(model_path)
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assembler = TextAssembler(detok, ["fox jum", "never"])
    out = ""
    for t in ids:
        out += assembler.add_token(t)
        assert "fox" not in out or "fox jum" not in out
        if assembler.stopped:
            break
    assert assembler.stopped
    assert out + assembler.finish() == "The quick brown "
