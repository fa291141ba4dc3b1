"""Prefill of one request on its own cache, one chunk at a time.

The split mirrors mlx-vlm's ``generate_step``: the prompt minus its last token goes
through the language model in chunks of ``step_size`` (outputs discarded), then the last
token alone gives the logits of the first sampled token. Only last-position logits are
ever computed. The scheduler runs chunks up to a token budget between decode steps, so
running streams keep flowing while a long prompt is prefilled. A prompt may start from
the prefix cache (keyed by its tokens and, where it has images, their digests) and
prefill only what the cache does not hold, then in one pass where it can
(``_rest_in_one_pass``). Where last passes are bucketed (on a GPU), a last pass is
padded to a coarse length so its shapes repeat from prompt to prompt
(``last_pass_length``).
"""

from __future__ import annotations

import copy
import functools

import mlx.core as mx
import numpy as np
from mlx_vlm.models import cache as vlm_cache

from .decode.store import round_up_coarsely
from .families import Family
from .model_inputs import model_arrays
from .prefix_cache import PrefixCache, prefix_key
from .types import PreparedRequest

# Bucketed last passes are padded in steps of at least this many tokens.
PASS_STEP = 16


class Prefill:
    def __init__(
        self,
        model,
        family: Family,
        request: PreparedRequest,
        step_size: int,
        prefix_cache: PrefixCache | None = None,
        bucket_last_pass: bool = False,
    ):
        self.model = model
        self.family = family
        self.request = request
        self.step_size = max(1, step_size)
        self.bucket_last_pass = bucket_last_pass  # see ``last_pass_length``
        self.prefix_cache = prefix_cache if prefix_cacheable(family, request) else None
        self.reused = 0  # prompt tokens whose KV came from the prefix cache
        self._found: tuple[list | None, int] | None = None  # the prefix lookup, once made
        self._reuse_limit: int | None = None  # at most this many cached tokens (``reuse_at_most``)
        self.position = 0  # prompt tokens in the cache so far
        self.cache = vlm_cache.make_prompt_cache(model.language_model)
        self.input_ids: mx.array | None = None
        self.embeds: mx.array | None = None
        self.kwargs: dict = {}
        self.chunked = True
        self.logits: mx.array | None = None  # (1, V) once done
        self.row_state: dict | None = None  # what the row keeps for decoding, once done
        # The cache one token short of the prompt, kept where the full one could not be
        # trimmed back to it later (a rotated sliding window): an identical prompt (a
        # retry, a regenerate) then still finds it and prefills only its last token.
        self.short_cache: list | None = None
        self.group = None  # the PrefillGroup it shares passes with (prefill_batch), if any
        self.alone = False  # never shares passes (a shared pass with it failed)

    @property
    def done(self) -> bool:
        return self.logits is not None

    @property
    def started(self) -> bool:
        return self.embeds is not None or self.done

    @property
    def may_group(self) -> bool:
        """Free to join a shared pass: not started, in no group, not made to go alone."""
        return not (self.started or self.group or self.alone)

    def start(self) -> int:
        """Materialize the prepared numpy inputs and queue the vision tower. Returns its
        cost in prompt tokens (the scheduler's prefill budget counts these)."""
        inputs, features = self.materialize()
        return self.embed(inputs, features)

    def materialize(self) -> tuple[dict, object]:
        """The request's inputs as mx.arrays, and its image features where the vision
        cache holds them: then its pixels are never converted (they would go unused).
        Neither where the prompt's images all lie in its cached prefix and the family
        embeds the text after them alone (``Family.text_after_cached_images``)."""
        req = self.request
        # Built as (1, L) from the host's list, not reshaped on the device: families that
        # read the ids on the host (``QwenVL.merge``) then wait for no queued work.
        self.input_ids = mx.array(req.input_ids[None], dtype=mx.int32)
        if self._text_after_cached_images:
            return {}, None
        features = self.family.cached_features(req.image_digests) if req.has_media else None
        return model_arrays(req, leave_out=("pixel_values",) if features is not None else ()), features

    def embed(self, inputs: dict, features=None) -> int:
        """Embed the prompt (``features``: its images' projected features, already
        computed), or only what its cached prefix does not hold; returns the cost in
        prompt tokens."""
        req = self.request
        cache, reused = self._look_up()
        text_only = self._text_after_cached_images
        ids = mx.array(req.input_ids[None, reused:], dtype=mx.int32) if text_only else self.input_ids
        self.embeds, self.kwargs = self.family.embed(ids, inputs, () if text_only else req.image_digests, features)
        self.chunked = self.family.can_chunk_prefill(ids, self.embeds, self.cache, self.kwargs)
        if cache is not None:
            # Only the rest is prefilled. Position metadata in kwargs stays that of the
            # whole prompt: the models slice it by the cache offset, as mlx-vlm's own
            # prompt caching does.
            self.cache = cache
            self.position = reused
            if text_only:  # the ids embedded are already the rest's
                self.input_ids = ids
            else:
                self.input_ids = self.input_ids[:, reused:]
                self.embeds = self.embeds[:, reused:]
        mx.async_eval(self.embeds)
        return req.num_prompt_tokens if req.has_media else 1

    def _look_up(self) -> tuple[list | None, int]:
        """The cache of this prompt's longest stored prefix and its length (looked up
        once: a lookup copies the cache)."""
        if self._found is None:
            found = (self.prefix_cache.lookup(self._key(), self._reuse_limit)
                     if self.prefix_cache is not None else None)
            self._found = found if found is not None and found[0] is not None else (None, 0)
            self.reused = self._found[1]
        return self._found

    def reusable(self, at_most: int | None = None) -> int:
        """How many prompt tokens the prefix cache holds for this prompt (of at most
        ``at_most``), before it is looked up."""
        if self.prefix_cache is None or self._found is not None:
            return self.reused
        return self.prefix_cache.reusable(self._key(), at_most)

    @functools.cached_property
    def _image_positions(self) -> np.ndarray:
        """Where the prompt's image placeholders are (none for a text prompt)."""
        req = self.request
        if not req.has_media:
            return np.zeros(0, np.int64)
        return np.flatnonzero(np.isin(req.input_ids, list(self.family.image_token_ids)))

    @property
    def leading_text(self) -> int:
        """How many of the prompt's tokens come before its first image placeholder."""
        images = self._image_positions
        return int(images[0]) if images.size else len(self.request.input_ids)

    def reuse_at_most(self, n: int) -> None:
        """Take at most ``n`` tokens from the prefix cache (before it is looked up): the
        rest is prefilled. A prompt's tokens do not depend on how much of it came from
        the cache (the parity suite checks reuse against prefilling from none)."""
        self._reuse_limit = n

    @functools.cached_property
    def _text_after_cached_images(self) -> bool:
        """Whether the prompt's images all lie in its cached prefix and the family
        embeds the text after them alone (decided once, with the lookup)."""
        req = self.request
        if not (req.has_media and self.family.text_after_cached_images):
            return False
        _, reused = self._look_up()
        images = self._image_positions
        return reused > 0 and images.size > 0 and images[-1] < reused

    def remember(self) -> None:
        """Offer this prompt's finished cache to the prefix cache."""
        if self.prefix_cache is None or not self.done:
            return
        tokens = self._key()
        if self.short_cache is not None:
            self.prefix_cache.store(tokens[:-1], self.short_cache)
        else:
            self.prefix_cache.store(tokens, self.cache)

    def _key(self) -> list[int]:
        return cache_key(self.family, self.request, self.request.input_ids.tolist())

    def next_chunk(self) -> tuple[int, bool]:
        """The next pass over the prompt, as the single path would run it: how many
        tokens, and whether it is the last (the one whose logits are kept)."""
        remaining = self.embeds.shape[1]
        if self.chunked and remaining > 1 and not self._rest_in_one_pass(remaining):
            return min(self.step_size, remaining - 1), False
        return remaining, True

    def _rest_in_one_pass(self, remaining: int) -> bool:
        """A prompt that continues a cached prefix goes on in one pass where it fits one
        and no window rotates on the way: the cached prefix already parts from how the
        single path would chunk the prompt (turn 2 of a chat after turn 1's passes), so
        splitting off the last token again buys nothing, and every pass costs the host
        the same on a GPU."""
        if not self.reused or remaining > self.step_size:
            return False
        return not any(
            getattr(c, "max_size", None) and c.offset + remaining >= c.max_size for c in self.cache
        )

    def chunk_inputs(self, n: int) -> tuple[mx.array, mx.array, dict]:
        """Token ids, embeddings and language-model arguments of the next ``n`` tokens."""
        start = self.position
        kwargs = self.family.chunk_kwargs(self.kwargs, start, start + n)
        return self.input_ids[:, :n], self.embeds[:, :n], kwargs

    def advance(self, n: int) -> None:
        """``n`` more prompt tokens are in the cache."""
        self.input_ids = self.input_ids[:, n:]
        self.embeds = self.embeds[:, n:]
        self.position += n

    def keep_short_cache(self) -> None:
        """Before the last token: keep the cache one token short where the full one
        could not be trimmed back to it (see ``short_cache``)."""
        if self.prefix_cache is not None and _rotates_on_next_token(self.cache):
            self.short_cache = copy.deepcopy(self.cache)

    def finish(self, logits: mx.array, row_state: dict) -> None:
        self.logits = logits  # lazy: read back with the first token
        self.row_state = row_state
        self.input_ids = self.embeds = None

    def step(self) -> int:
        """Queue the next chunk; after the last one, ``logits`` is set.
        Returns the number of prompt tokens the step cost."""
        if self.embeds is None:
            return self.start()
        n, last = self.next_chunk()
        ids, embeds, kwargs = self.chunk_inputs(n)
        if not last:
            prefill_pass(self.model, self.family, ids, embeds, self.cache, kwargs, n)
            mx.async_eval([c.state for c in self.cache])
            self.advance(n)
            return n
        if n == 1:
            self.keep_short_cache()
        padded = last_pass_length([self], n, kwargs)
        ends = mx.array([n - 1]) if padded > n else None
        logits, out = prefill_pass(self.model, self.family, pad_tokens(ids, padded),
                                   pad_tokens(embeds, padded), self.cache, kwargs, last_positions=ends)
        if padded > n:
            for layer in self.cache:
                layer.trim(padded - n)  # the padding: the cache ends where the prompt does
        self.advance(n)
        self.finish(logits, self.family.row_state(self.kwargs, out))
        return n


def prefix_cacheable(family: Family, request: PreparedRequest) -> bool:
    """Whether ``request``'s KV may be stored and reused: prompts with images only
    where the family's image placeholders are known (they are keyed by the images)."""
    return family.prefix_cache and (
        not request.has_media or bool(family.image_prefix_cache and family.image_token_ids)
    )


def cache_key(family: Family, request: PreparedRequest, tokens: list[int]) -> list[int]:
    """The prefix cache's key of ``tokens``: ``request``'s prompt, possibly followed by
    tokens it generated, with its image placeholders marked by its images."""
    return prefix_key(tokens, family.image_token_ids, request.image_digests)


def prefill_pass(model, family, ids, embeds, cache, kwargs: dict, n_to_process: int | None = None,
                 last_positions: mx.array | None = None):
    """One language-model pass over ``cache``. A last pass (``n_to_process`` None)
    returns each row's last logits (rows, vocab), at ``last_positions`` (one per row)
    where rows are padded, else at the end, and the model's output (None where the
    family's decoder ran the pass: on fused weights, with the output layer on those
    positions only)."""
    decoder = family.prefill_decoder(kwargs)
    if decoder is not None:
        hidden = decoder.prefill(embeds, cache, last_positions)
        return None if n_to_process is not None else (decoder.head_of(hidden), None)
    lm = model.language_model
    if n_to_process is not None:
        lm(inputs=ids, inputs_embeds=embeds, cache=cache, n_to_process=n_to_process,
           logits_to_keep=1, **kwargs)
        return None
    if last_positions is None:
        out = lm(ids, inputs_embeds=embeds, cache=cache, logits_to_keep=1, **kwargs)
        return out.logits[:, -1, :], out
    # Rows end at their own positions: every position's logits (no logits_to_keep).
    out = lm(ids, inputs_embeds=embeds, cache=cache, **kwargs)
    return mx.take_along_axis(out.logits, last_positions[:, None, None], axis=1)[:, 0, :], out


def last_pass_length(prefills: list[Prefill], n: int, kwargs: dict) -> int:
    """Tokens the last pass of ``prefills`` runs, ``n`` being its longest prompt's: ``n``,
    or, where last passes are bucketed, ``n`` rounded up coarsely, each prompt's tokens
    first and zeros after (causal attention never reads them; they are trimmed from its
    cache after). On a GPU a pass of a new length costs the host several ms of
    per-shape setup (cuBLAS and attention plans), and every chat turn brings another
    length: bucketed, turn 2 of one chat runs the shapes of another's. Only where the
    family pads last passes, its own decoder runs the pass (the model code would
    compute every position's logits) and the padding fills no sliding window."""
    first = prefills[0]
    if n < 2 or not (first.bucket_last_pass and first.family.pad_last_prefill
                     and first.family.prefill_decoder(kwargs) is not None):
        return n
    padded = round_up_coarsely(n, PASS_STEP)
    return padded if all(fits_padding(p, padded) for p in prefills) else n


def fits_padding(prefill: Prefill, length: int) -> bool:
    """Whether a pass of ``length`` tokens from where ``prefill`` is fills no sliding
    window, so trimming its padding off leaves the cache the prompt's own pass leaves."""
    windows = [c.max_size for c in prefill.cache if getattr(c, "max_size", None)]
    return all(prefill.position + length < w for w in windows)


def pad_tokens(x: mx.array, n: int) -> mx.array:
    """``x`` (rows, k, ...) followed by zeros up to ``n`` along the tokens."""
    k = x.shape[1]
    if k == n:
        return x
    return mx.concatenate([x, mx.zeros((x.shape[0], n - k, *x.shape[2:]), x.dtype)], axis=1)


def _rotates_on_next_token(cache: list) -> bool:
    """Whether one more token leaves some layer's window full, so the cache can no
    longer be trimmed back to where it is now."""
    return any(getattr(c, "max_size", None) and c.offset + 1 >= c.max_size for c in cache)
