"""Constrained decoding with llguidance: JSON mode and JSON Schema.

A grammar row's allowed tokens depend on the tokens it has already produced, so while
such a row runs the scheduler reads each step back before queuing the next one. The
allowed-token bitmasks of all rows become one (B, V) mask per step, unpacked with a few
MLX ops; rows without a grammar allow everything.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np


# One conventional layout: free whitespace lets a model pad forever before closing the
# object. A schema may still choose otherwise through its own "x-guidance" options.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(response_format: dict) -> str | None:
    """The llguidance grammar for an OpenAI ``response_format``; None for plain text.
    Raises ValueError with a user-facing message for a format that cannot be used."""
    import llguidance

    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
    else:
        raise ValueError(f"unknown response_format type {kind!r}")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_STYLE)
    ok, error = _validate(grammar)
    if not ok:
        raise ValueError(f"unsupported JSON schema: {error}")
    return grammar


def _validate(grammar: str) -> tuple[bool, str]:
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    return (not error, error)


class GrammarCompiler:
    """Makes matchers for grammars; builds llguidance's view of the tokenizer once."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._llg_tokenizer = None

    def matcher(self, grammar: str):
        import llguidance
        import llguidance.hf

        if self._llg_tokenizer is None:  # about a second for a large vocabulary
            self._llg_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
            )
        return llguidance.LLMatcher(self._llg_tokenizer, grammar)


def allowed_tokens(matchers: list, vocab_size: int) -> mx.array | None:
    """A (B, V) bool mask of the tokens each row may sample next; None if no row has a
    grammar."""
    if not any(m is not None for m in matchers):
        return None
    import llguidance.numpy as llg_numpy

    words = (vocab_size + 31) // 32
    bits = np.full((len(matchers), words), -1, dtype=np.int32)
    for i, matcher in enumerate(matchers):
        if matcher is not None:
            llg_numpy.fill_next_token_bitmask(matcher, bits, i)
    packed = mx.array(bits).view(mx.uint32)
    shifts = mx.arange(32, dtype=mx.uint32)
    unpacked = (packed[:, :, None] >> shifts) & 1
    return unpacked.reshape(len(matchers), words * 32)[:, :vocab_size].astype(mx.bool_)
