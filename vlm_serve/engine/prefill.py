"""Prefill of one request on its own cache, one chunk at a time.

The split mirrors mlx-vlm's ``generate_step``: the prompt minus its last token goes
through the language model in chunks of ``step_size`` (outputs discarded), then the last
token alone gives the logits of the first sampled token. Only last-position logits are
ever computed. The scheduler runs chunks up to a token budget between decode steps, so
running streams keep flowing while a long prompt is prefilled. A prompt may start from
the prefix cache (keyed by its tokens and, where it has images, their digests) and
prefill only what the cache does not hold.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_vlm.models import cache as vlm_cache

from .families import Family
from .prefix_cache import PrefixCache, prefix_key
from .types import PreparedRequest


class Prefill:
    def __init__(
        self,
        model,
        family: Family,
        request: PreparedRequest,
        step_size: int,
        prefix_cache: PrefixCache | None = None,
    ):
        self.model = model
        self.family = family
        self.request = request
        self.step_size = max(1, step_size)
        usable = family.prefix_cache and (
            not request.has_media or (family.image_prefix_cache and family.image_token_ids)
        )
        self.prefix_cache = prefix_cache if usable else None
        self.reused = 0  # prompt tokens whose KV came from the prefix cache
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

    @property
    def done(self) -> bool:
        return self.logits is not None

    def start(self) -> int:
        """Materialize the prepared numpy inputs and queue the vision tower. Returns its
        cost in prompt tokens (the scheduler's prefill budget counts these)."""
        req = self.request
        self.input_ids = mx.array(req.input_ids, dtype=mx.int32)[None]
        inputs = {
            k: [mx.array(a) for a in v] if isinstance(v, list) else mx.array(v)
            for k, v in req.model_inputs.items()
        }
        self.embeds, self.kwargs = self.family.embed(self.input_ids, inputs, req.image_digests)
        self.chunked = self.family.can_chunk_prefill(
            self.input_ids, self.embeds, self.cache, self.kwargs
        )
        if self.prefix_cache is not None:
            cache, self.reused = self.prefix_cache.lookup(self._key())
            if cache is not None:
                # Only the rest is prefilled. Position metadata in kwargs stays that of the
                # whole prompt: the models slice it by the cache offset, as mlx-vlm's own
                # prompt caching does.
                self.cache = cache
                self.position = self.reused
                self.input_ids = self.input_ids[:, self.reused:]
                self.embeds = self.embeds[:, self.reused:]
        mx.async_eval(self.embeds)
        return self.request.num_prompt_tokens if self.request.has_media else 1

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
        req = self.request
        return prefix_key(req.input_ids.tolist(), self.family.image_token_ids, req.image_digests)

    def step(self) -> int:
        """Queue the next chunk; after the last one, ``logits`` is set.
        Returns the number of prompt tokens the step cost."""
        if self.embeds is None:
            return self.start()
        lm = self.model.language_model
        remaining = self.embeds.shape[1]
        start = self.position
        if self.chunked and remaining > 1:
            n = min(self.step_size, remaining - 1)
            lm(
                inputs=self.input_ids[:, :n],
                inputs_embeds=self.embeds[:, :n],
                cache=self.cache,
                n_to_process=n,
                logits_to_keep=1,
                **self.family.chunk_kwargs(self.kwargs, start, start + n),
            )
            mx.async_eval([c.state for c in self.cache])
            self.input_ids = self.input_ids[:, n:]
            self.embeds = self.embeds[:, n:]
            self.position += n
            return n
        if self.prefix_cache is not None and remaining == 1 and _rotates_on_next_token(self.cache):
            self.short_cache = copy.deepcopy(self.cache)
        out = lm(
            self.input_ids[:, -remaining:],
            inputs_embeds=self.embeds,
            cache=self.cache,
            logits_to_keep=1,
            **self.family.chunk_kwargs(self.kwargs, start, start + remaining),
        )
        self.logits = out.logits[:, -1, :]  # lazy: read back with the first token
        self.row_state = self.family.row_state(self.kwargs, out)
        self.position += remaining
        self.input_ids = self.embeds = None
        return remaining


def _rotates_on_next_token(cache: list) -> bool:
    """Whether one more token leaves some layer's window full, so the cache can no
    longer be trimmed back to where it is now."""
    return any(getattr(c, "max_size", None) and c.offset + 1 >= c.max_size for c in cache)
