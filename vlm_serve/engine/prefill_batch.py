"""Prefill of several prompts together, each ending with the cache it would have alone.

A burst of requests would otherwise run one vision-tower call and one language-model
pass per chunk per request, each paying its graph building on the host. Here:

- The images of requests that start together run through the vision tower in one call
  where their processed shapes allow (``Family.stack_image_inputs``); the features are
  split back per request and cached as the single path would cache them. Images the
  vision cache holds never run again.
- Prompts share a language-model pass wherever the single path would run the very same
  pass for each of them: the same number of tokens from the same position, with
  arguments of the same shapes (``Family.batch_signature``). Prompts of one length share
  every pass; prompts of different lengths share their leading full chunks, then go
  on from their own rows of the shared cache, in smaller groups where their next passes
  still match, else alone. Where a family pads (``Family.pad_last_prefill``), last
  passes of different lengths share one pass too: each prompt's tokens first and
  zeros after, which causal attention never reads and which are trimmed from its cache
  after, never where a sliding window would fill. A row of a shared pass computes
  exactly what it computes alone (the parity suite's burst cases prove it per family; a
  family batches only under its flags).

Prompts that start from the same cached prefix (or from none) share passes from its
end; each set of them is a group of its own.
"""

from __future__ import annotations

import copy
import os

import mlx.core as mx
from mlx_vlm.models import cache as vlm_cache

from .families import Family
from .prefill import (
    Prefill,
    _rotates_on_next_token,
    fits_padding,
    last_pass_length,
    pad_tokens,
    prefill_pass,
)

# Layer caches whose rows can be sliced apart: the single-request caches a prompt gets.
_SPLITTABLE = (vlm_cache.KVCache, vlm_cache.RotatingKVCache)

# Cached tokens a prompt gives up, to be prefilled again, so as to share its passes with
# prompts whose cached prefix is shorter (see ``PrefillGroup._align_prefixes``;
# VLM_SERVE_REPREFILL_TOKENS=0 turns it off, for comparison).
REPREFILL_TOKENS = int(os.environ.get("VLM_SERVE_REPREFILL_TOKENS", "16"))


class PrefillGroup:
    def __init__(self, model, family: Family, members: list[Prefill]):
        self.model = model
        self.family = family
        self.members = list(members)  # in the rows' order once ``cache`` exists
        self.cache: list | None = None  # shared layer caches, one row per member
        # What the last step shared: rows of a language-model pass, requests of tower calls.
        self.shared_rows = self.shared_towers = 0
        self.splittable = all(
            type(c) in _SPLITTABLE for c in vlm_cache.make_prompt_cache(model.language_model)
        )
        for member in self.members:
            member.group = self

    # -- membership -------------------------------------------------------------------

    def drop(self, member: Prefill) -> None:
        """``member`` leaves and is forgotten (its request was cancelled)."""
        self._leave([member], keep_rows=False)

    def _leave(self, leaving: list[Prefill], keep_rows: bool = True) -> None:
        """``leaving`` go on alone, each with its own row of the shared cache."""
        gone = {id(m) for m in leaving}
        rows = [i for i, m in enumerate(self.members) if id(m) in gone]
        if not rows:
            return
        if self.cache is not None:
            if keep_rows:
                for i in rows:
                    self.members[i].cache = _rows(self.cache, slice(i, i + 1))
            stay = [i for i in range(len(self.members)) if id(self.members[i]) not in gone]
            self.cache = _rows(self.cache, mx.array(stay, mx.int32)) if stay else None
        for i in rows:
            self.members[i].group = None
        self.members = [m for m in self.members if id(m) not in gone]

    # -- the vision towers and embeddings -----------------------------------------------

    def start(self) -> int:
        """Materialize every member, run their uncached images through shared tower
        calls and embed them. Returns the cost in prompt tokens (as ``Prefill.start``)."""
        self._align_prefixes()
        prepared = [(m, *m.materialize()) for m in self.members]
        features = self._encode_together(prepared)
        cost = 0
        for member, inputs, cached in prepared:
            cost += member.embed(inputs, cached if cached is not None else features.get(id(member)))
        family = self.family
        self._leave([m for m in self.members if m.request.has_media and not family.batch_prefill_images])
        # Prompts that start from the same cached prefix (a chat template's opening, a
        # shared system prompt, or none) go on together from its end.
        self._split(_partition(self.members, lambda a, b: _same_layout(a.cache, b.cache)))
        return cost

    def _align_prefixes(self) -> None:
        """Prompts find cached prefixes of slightly different lengths (a chat template's
        opening, and a word or two more that an earlier prompt happened to share): each
        length would be a group of its own, each paying a pass. Those within
        ``REPREFILL_TOKENS`` of the shortest go on from the shortest instead, and
        prefill their few extra tokens in the shared pass. Only prefixes of text: one
        that holds a prompt's images stays whole."""
        found = {id(m): m.reusable() for m in self.members}
        text = [m for m in self.members if found[id(m)] <= m.leading_text]
        shortest = min((found[id(m)] for m in text if found[id(m)] > 0), default=0)
        for member in text:
            n = found[id(member)]
            if shortest < n <= shortest + REPREFILL_TOKENS and member.reusable(shortest) == shortest:
                member.reuse_at_most(shortest)

    def _encode_together(self, prepared: list) -> dict[int, object]:
        """Features of members whose images share a tower call, by ``id(member)``.
        Members left out embed their images themselves (``Family.embed``)."""
        if not self.family.batch_vision:
            return {}
        buckets: dict[tuple, list] = {}
        for member, inputs, cached in prepared:
            pixels = inputs.get("pixel_values")
            if cached is None and member.request.has_media and isinstance(pixels, mx.array):
                key = (tuple(pixels.shape[1:]), str(pixels.dtype))
                buckets.setdefault(key, []).append((member, inputs))
        out = {}
        for call in (c for bucket in buckets.values() for c in self._tower_calls(bucket)):
            per_request = [{k: v for k, v in inputs.items() if k != "attention_mask"}
                           for _, inputs in call]
            stacked = self.family.stack_image_inputs(per_request)
            if stacked is None:
                continue
            first_ids = call[0][0].input_ids
            encoded = self.family.encode_images(first_ids, stacked["pixel_values"], stacked)
            if encoded is None:
                continue
            self.shared_towers += len(call)
            for (member, _), features in zip(call, self.family.split_image_features(encoded, per_request)):
                out[id(member)] = features
                if member.request.image_digests:
                    self.family.vision_cache.put(member.request.image_digests, features)
        return out

    def _tower_calls(self, bucket: list) -> list[list]:
        """The shared tower calls of a bucket of (member, inputs) whose images have one
        shape: the whole bucket, or on CUDA calls of checked sizes (``tower_sharing``)."""
        if len(bucket) < 2:
            return []
        sharing = self.family.tower_sharing
        if sharing is None:
            return [bucket]
        return [[bucket[i] for i in call] for call in sharing.calls([inputs for _, inputs in bucket])]

    # -- the language model -------------------------------------------------------------

    def step(self) -> int:
        """One shared pass (the first call: ``start``) of the first member and those
        whose next pass is the very same (tokens, whether it is the last, argument
        shapes), or, where the family pads, a last pass within twice its length.
        Returns the pass's cost in prompt tokens: 0 when the first member has no one to
        share with (it then steps alone)."""
        self.shared_rows = self.shared_towers = 0
        if not any(m.started for m in self.members):
            return self.start()
        if not self.splittable:
            self._leave(list(self.members))
            return 0
        plans = {id(m): m.next_chunk() for m in self.members}
        signatures: dict[int, tuple | None] = {}

        def signature(member: Prefill) -> tuple | None:
            # Only for members whose pass matches another's: a family's signature may
            # read a device value back (Gemma's image-token check).
            if id(member) not in signatures:
                n = plans[id(member)][0]
                signatures[id(member)] = self.family.batch_signature(member.chunk_inputs(n)[2])
            return signatures[id(member)]

        # Members whose next pass is their last and may be padded to the longest last
        # pass (the padding fills no sliding window).
        longest = max((n for n, last in plans.values() if last), default=0)
        paddable = ({id(m) for m in self.members if plans[id(m)][1] and fits_padding(m, longest)}
                    if self.family.pad_last_prefill else set())

        def padded_together(a: Prefill, b: Prefill) -> bool:
            # Within twice each other's length (so within four times the shortest of a
            # pass that pads to its longest): padding costs a row little.
            na, nb = plans[id(a)][0], plans[id(b)][0]
            return id(a) in paddable and id(b) in paddable and 2 * min(na, nb) >= max(na, nb)

        def same_pass(a: Prefill, b: Prefill) -> bool:
            if plans[id(a)] != plans[id(b)] and not padded_together(a, b):
                return False
            return signature(a) is not None and signature(a) == signature(b)

        self._split(_partition(self.members, same_pass))
        if len(self.members) < 2:
            self._leave(list(self.members))
            return 0
        return self._pass([plans[id(m)][0] for m in self.members], plans[id(self.members[0])][1])

    def _split(self, parts: list[list[Prefill]]) -> None:
        """Keep the part holding the first member; every other part of two or more
        goes on as a group of its own, and the rest alone."""
        head = self.members[0] if self.members else None
        keep = next((part for part in parts if head in part), [])
        self._leave([m for m in self.members if m not in keep])
        for part in parts:
            if part is not keep and len(part) > 1:
                PrefillGroup(self.model, self.family, part)

    def _pass(self, lengths: list[int], last: bool) -> int:
        """One pass of ``lengths[i]`` tokens of each member: of one length, or, for a
        last pass, each padded to the longest (see ``Family.pad_last_prefill``), or
        further where last passes are bucketed (``prefill.last_pass_length``)."""
        inputs = [m.chunk_inputs(k) for m, k in zip(self.members, lengths)]
        kwargs = self.family.stack_chunk_kwargs([x[2] for x in inputs])
        n = last_pass_length(self.members, max(lengths), kwargs) if last else max(lengths)
        ids = mx.concatenate([pad_tokens(x[0], n) for x in inputs])
        embeds = mx.concatenate([pad_tokens(x[1], n) for x in inputs])
        rows = self.shared_rows = len(self.members)
        if self.cache is None:
            self.cache = _stacked([m.cache for m in self.members])
        if not last:
            prefill_pass(self.model, self.family, ids, embeds, self.cache, kwargs, n)
            mx.async_eval([c.state for c in self.cache])
            for member in self.members:
                member.advance(n)
            return n * rows
        if n == 1 and _rotates_on_next_token(self.cache):
            for i, member in enumerate(self.members):
                if member.prefix_cache is not None:
                    member.short_cache = _rows(self.cache, slice(i, i + 1))
        ends = mx.array([k - 1 for k in lengths], mx.int32) if min(lengths) < n else None
        logits, _ = prefill_pass(self.model, self.family, ids, embeds, self.cache, kwargs,
                                 last_positions=ends)
        for i, (member, k) in enumerate(zip(self.members, lengths)):
            member.cache = _rows(self.cache, slice(i, i + 1))
            for layer in member.cache:
                layer.trim(n - k)  # its padding: the cache ends where its prompt does
            member.advance(k)
            # A family that batches prefill keeps nothing of the last output per row.
            member.finish(logits[i:i + 1], self.family.row_state(member.kwargs, None))
            member.group = None
        self.members, self.cache = [], None
        return n * rows


def _partition(members: list[Prefill], alike) -> list[list[Prefill]]:
    """``members`` in parts of mutually ``alike`` ones, in order of first appearance."""
    parts: list[list[Prefill]] = []
    for member in members:
        part = next((p for p in parts if alike(member, p[0])), None)
        if part is None:
            parts.append([member])
        else:
            part.append(member)
    return parts


def _same_layout(cache: list, other: list) -> bool:
    """Whether two single-row caches can be rows of one batch cache: both empty, or
    holding the same number of tokens in buffers of the same shape (the same cached
    prefix)."""
    for a, b in zip(cache, other):
        if type(a) is not type(b) or a.offset != b.offset or getattr(a, "_idx", 0) != getattr(b, "_idx", 0):
            return False
        if (a.keys is None) != (b.keys is None):
            return False
        if a.keys is not None and (a.keys.shape != b.keys.shape or a.values.shape != b.values.shape):
            return False
    return len(cache) == len(other)


def _stacked(caches: list[list]) -> list:
    """One batch cache of single-row caches of the same layout, rows in order."""
    out = []
    for layers in zip(*caches):
        layer = copy.copy(layers[0])
        if layer.keys is not None:
            layer.keys = mx.concatenate([c.keys for c in layers])
            layer.values = mx.concatenate([c.values for c in layers])
        out.append(layer)
    return out


def _rows(cache: list, index) -> list:
    """Layer caches holding only the rows at ``index`` (a slice or an index array)."""
    out = []
    for layer in cache:
        rows = copy.copy(layer)
        rows.keys, rows.values = layer.keys[index], layer.values[index]
        out.append(rows)
    return out
