"""Loading a model with mlx-vlm and reading the facts the server needs from it."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..preprocess import fast_pixels
from ..preprocess.chat_format import processor_template
from . import tower_gelu
from .detokenize import make_detokenizer

log = logging.getLogger("vlm_serve.engine")


@dataclass
class LoadedModel:
    model: Any
    processor: Any
    path: Path
    model_type: str
    eos_token_ids: set[int]
    vocab_size: int
    max_model_len: int
    chat_template: str | None
    detokenizer: Any
    sampling_defaults: dict


    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _eos_ids(model, processor, path: Path) -> set[int]:
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = _as_set(getattr(model.config, "eos_token_id", None))
    gen_config = path / "generation_config.json"
    if gen_config.exists():
        ids |= _as_set(json.loads(gen_config.read_text()).get("eos_token_id"))
    criteria = getattr(tokenizer, "stopping_criteria", None)
    ids |= _as_set(getattr(criteria, "eos_token_ids", None))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _sampling_defaults(path: Path) -> dict:
    """The checkpoint's recommended sampling settings (``generation_config.json``)."""
    gen_config = path / "generation_config.json"
    if not gen_config.exists():
        return {}
    config = json.loads(gen_config.read_text())
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: config[k] for k in keys if isinstance(config.get(k), (int, float))}


def _max_model_len(model) -> int:
    text_config = getattr(model.config, "text_config", model.config)
    for name in ("max_position_embeddings", "max_seq_len", "max_sequence_length"):
        value = getattr(text_config, name, None) or getattr(model.config, name, None)
        if value:
            return int(value)
    return 8192


def resolve_chat_template(path: Path, processor) -> str | None:
    """The checkpoint's own template first (a processor class may carry a built-in one
    that differs), then whatever the processor or its tokenizer holds."""
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        file = path / name
        if file.exists() and (template := read_chat_template(file)):
            return template
    return processor_template(processor)


def read_chat_template(file: Path) -> str | None:
    """A template file: a ``.json`` one holds it under "chat_template" (as
    chat_template.json and tokenizer_config.json do); any other is the template."""
    if file.suffix != ".json":
        return file.read_text()
    template = json.loads(file.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None


def load(model: str, chat_template: str | None = None, lazy: bool = False) -> LoadedModel:
    """Load ``model`` (a local directory or a Hugging Face repo id) on this thread;
    ``chat_template`` (the text of --chat-template) replaces the checkpoint's. ``lazy``
    leaves the weights unread until evaluated (a tensor-parallel rank shards first)."""
    from mlx_vlm import load as vlm_load
    from mlx_vlm.utils import get_model_path

    started = time.monotonic()
    log.info("loading %s", model)  # a repo id may download first
    path = Path(get_model_path(model))
    from ..distributed.random_weights import load_unwritten

    # A benchmark preset too large to write (vlm_serve.distributed.random_weights) is
    # built in memory; anything else is a checkpoint.
    vlm_model, processor = load_unwritten(path) or vlm_load(str(path), lazy=lazy)
    images = getattr(processor, "image_processor", None)
    if images is not None and fast_pixels.install(images):
        log.info("%s: pixels rescaled and normalized the faster way, to the same bits",
                 type(images).__name__)
    gelus = tower_gelu.install(vlm_model)
    if gelus:
        log.info("%d GELU layers in the %s form for 16-bit activations, to MLX's bits", gelus,
                 tower_gelu.form_here())
    # One token through the language model: warms up and tells the logits width,
    # which may differ from the tokenizer's size.
    from mlx_vlm.models import cache as vlm_cache

    probe = vlm_model.language_model(
        mx.array([[0]], mx.int32), cache=vlm_cache.make_prompt_cache(vlm_model.language_model)
    )
    vocab_size = int(probe.logits.shape[-1])
    loaded = LoadedModel(
        model=vlm_model,
        processor=processor,
        path=path,
        model_type=str(getattr(vlm_model.config, "model_type", "")),
        eos_token_ids=_eos_ids(vlm_model, processor, path),
        vocab_size=vocab_size,
        max_model_len=_max_model_len(vlm_model),
        chat_template=chat_template or resolve_chat_template(path, processor),
        sampling_defaults=_sampling_defaults(path),
        detokenizer=make_detokenizer(path, getattr(processor, "tokenizer", processor)),
    )
    log.info(
        "loaded %s (%s, %s on disk) in %.1f s: vocab=%d max_model_len=%d eos=%s%s",
        model, loaded.model_type, _disk_size(path), time.monotonic() - started, vocab_size,
        loaded.max_model_len, sorted(loaded.eos_token_ids),
        "; chat template from --chat-template" if chat_template else "",
    )
    return loaded


def _disk_size(path: Path) -> str:
    # stat() follows the Hugging Face cache's symlinks to the blobs they name.
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
