"""From OpenAI chat messages to a ``PreparedRequest``: images, template, tokens.

Runs on the CPU pool. The model's own processor does the image work (resizing,
normalising, expanding image placeholders into image tokens); its numpy outputs are
handed to the worker, which alone makes MLX arrays.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass, field

import numpy as np
from mlx_vlm.prompt_utils import SINGLE_IMAGE_ONLY_MODELS
from mlx_vlm.utils import should_add_special_tokens

from ..engine.types import PreparedRequest, SamplingParams
from . import packed_pixels
from .chat_format import ChatFormat, processor_template
from .image_cache import CachingProcessor, ImageCache, handing_over
from .media import MediaError, MediaPolicy, PixelBudget, cache_digest, load_image
from .tool_prompt import inline_tools, text_of

log = logging.getLogger(__name__)


class PromptError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass
class PromptContext:
    """What preprocessing needs to know about the served model. ``chat_template``
    defaults to the processor's (or its tokenizer's) own."""

    processor: object
    model_type: str
    media: MediaPolicy
    max_images: int
    chat_template: str | None = None
    max_prompt_tokens: int | None = None  # the context: longer prompts are refused
    trust_request_template: bool = False  # clients may send their own chat template
    max_pixels_per_request: int | None = None
    # Loaded and processed images of recent requests (None: every image is processed).
    image_cache: ImageCache | None = None
    chat_format: ChatFormat = field(init=False)
    longest_token_bytes: int = field(init=False)
    # What each (channel, uint8 value) of the pixels becomes, where the image processor
    # hands uint8 values (``packed_pixels``); None: it hands floats.
    pixel_table: np.ndarray | None = field(init=False)
    # The processor that request images go through: the model's own, or a copy whose
    # image processor stops at uint8 values, answers from image_cache, or both.
    request_processor: object = field(init=False)

    def __post_init__(self):
        if self.model_type in SINGLE_IMAGE_ONLY_MODELS:
            # mlx-vlm's model code for these uses only the first image of a request.
            self.max_images = min(self.max_images, 1)
        if self.chat_template is None:
            self.chat_template = processor_template(self.processor)
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.chat_format = ChatFormat.detect(tokenizer, self.chat_template, self.model_type)
        self.longest_token_bytes = max(len(t.encode()) for t in tokenizer.get_vocab())
        self.pixel_table = packed_pixels.table_for(self.processor)
        base = self.processor if self.pixel_table is None else packed_pixels.packing(self.processor)
        self.request_processor = CachingProcessor.wrap(base, self.image_cache) or base

    @property
    def max_prompt_bytes(self) -> int | None:
        """Text longer than this cannot fit the context whatever it says: no token of
        the vocabulary covers more bytes, so it is refused without tokenizing."""
        if self.max_prompt_tokens is None:
            return None
        return self.max_prompt_tokens * self.longest_token_bytes


# Arguments of apply_chat_template that are not template variables, and variables that
# belong to the server: a client's chat_template_kwargs never set these.
_RESERVED_TEMPLATE_KWARGS = {
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "chat_template", "bos_token", "eos_token", "raise_exception",
    "strftime_now",
}


def _template_messages(messages: list[dict]) -> tuple[list[dict], list[tuple[str, str, str | None]]]:
    """OpenAI messages -> the shape HF chat templates expect, plus the images in order
    as (url, request field, detail)."""
    out, images = [], []
    for i, msg in enumerate(messages):
        role = "system" if msg["role"] == "developer" else msg["role"]
        content = msg.get("content")
        item: dict = {"role": role}
        if isinstance(content, list) and any(p.get("type") == "image_url" for p in content):
            parts = []
            for j, part in enumerate(content):
                if part["type"] == "text":
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    image = part["image_url"]
                    url = image["url"] if isinstance(image, dict) else image
                    detail = image.get("detail") if isinstance(image, dict) else None
                    images.append((url, f"messages[{i}].content[{j}].image_url", detail))
                    parts.append({"type": "image"})
            item["content"] = parts
        else:
            item["content"] = text_of(content)
        if msg.get("tool_calls"):
            item["tool_calls"] = [_template_tool_call(c) for c in msg["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None:
                item[key] = msg[key]
        out.append(item)
    return out, images


def _template_tool_call(call: dict) -> dict:
    # Templates want arguments as a mapping; OpenAI sends a JSON string.
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    return {"id": call.get("id"), "type": call.get("type", "function"), "function": function}


def render_chat(
    ctx: PromptContext, messages: list[dict], tools: list[dict] | None = None, template_kwargs=None,
    add_generation_prompt: bool = True,
) -> str:
    requested = dict(template_kwargs or {})
    template = requested.pop("chat_template", None)
    if template is not None and not ctx.trust_request_template:
        raise PromptError(
            "chat_template_kwargs.chat_template is refused: this server renders the model's "
            "own chat template (an operator may allow client templates with "
            "--trust-request-chat-template)", "chat_template_kwargs", "unsupported_value",
        )
    # Only variables the template reads reach it; the rest would change nothing or
    # reach apply_chat_template itself.
    kwargs = {
        k: v for k, v in requested.items()
        if k in ctx.chat_format.variables and k not in _RESERVED_TEMPLATE_KWARGS
    }
    if tools:
        kwargs["tools"] = tools
    if not add_generation_prompt:  # /tokenize may ask for the conversation alone
        kwargs["add_generation_prompt"] = False
    try:
        return ctx.chat_format.render(ctx.processor, messages, template, **kwargs)
    except Exception as exc:  # template errors are caused by the request's shape
        raise PromptError(f"could not render the chat template: {exc}", "messages") from exc


def tokenize(
    ctx: PromptContext, prompt: str, images: list, add_special: bool | None = None
) -> tuple[np.ndarray, dict]:
    """Token ids and other model inputs, exactly as mlx-vlm's ``prepare_inputs`` makes them.
    ``add_special`` (BOS and the like) defaults to what mlx-vlm does after a chat template."""
    processor = ctx.processor
    if add_special is None:
        add_special = should_add_special_tokens(ctx.model_type, processor)
    if not images:
        tokenizer = getattr(processor, "tokenizer", processor)
        ids = tokenizer(prompt, add_special_tokens=add_special)["input_ids"]
        return np.asarray(ids, dtype=np.int32).reshape(-1), {}
    inputs = _process_images(ctx, prompt, images, add_special)
    if "images" in inputs:
        inputs["pixel_values"] = inputs.pop("images")
    ids = _to_numpy(inputs.pop("input_ids")).astype(np.int32).reshape(-1)
    model_inputs = {k: _to_numpy(v) for k, v in inputs.items() if v is not None}
    return ids, model_inputs


def _process_images(ctx: PromptContext, prompt: str, images: list, add_special: bool) -> dict:
    """The request processor's call, again with plain pixels where it failed on held
    ones (``image_cache.HeldArray``): then it gets plain ones from then on."""
    try:
        return _process(ctx.request_processor, prompt, images, add_special)
    except Exception:
        holder = handing_over(ctx.request_processor)
        if holder is None:
            raise
        holder.hand_over = False
        try:
            inputs = _process(ctx.request_processor, prompt, images, add_special)
        except Exception:
            holder.hand_over = True  # the request's inputs were at fault, not held pixels
            raise
        log.warning("%s does not take held pixels; handing it plain arrays",
                    type(ctx.processor).__name__)
        return inputs


def _process(processor, prompt: str, images: list, add_special: bool) -> dict:
    """The processor call of mlx-vlm's ``process_inputs`` for one prompt, without its
    ``padding`` argument: one prompt needs none, and transformers 5 image processors
    reject the unknown keyword when a processor forwards it (LLaVA's does)."""
    method = getattr(processor, "process", processor)
    args = {"text": [prompt], "images": images, "return_tensors": "np"}
    if "add_special_tokens" in inspect.signature(method).parameters:
        args["add_special_tokens"] = add_special
    return method(**args)


def _to_numpy(value):
    """Processor outputs as numpy. Some processors (e.g. mlx-vlm's Gemma 4) return MLX
    arrays whatever ``return_tensors`` says; they are read back here, on the thread that
    made them, so no MLX array ever crosses to the worker. Images of different sizes
    stay a list of arrays."""
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (int, float)):
        return [_to_numpy(v) for v in value]
    return np.asarray(value)


def chat_images(ctx: PromptContext, messages: list[dict]) -> list[tuple[str, str, str | None]]:
    """The (url, request field, detail) of every image in the messages, within the count
    limit."""
    _, refs = _template_messages(messages)
    if len(refs) > ctx.max_images:
        raise PromptError(
            f"too many images: {len(refs)} (this model takes at most {ctx.max_images} "
            "per request)",
            "messages", "too_many_images",
        )
    return refs


def load_chat_image(ctx: PromptContext, ref: tuple[str, str, str | None], budget: PixelBudget | None):
    url, param, detail = ref
    return load_image(url, ctx.media, param=param, budget=budget, detail=detail, cache=ctx.image_cache)


def prepare_chat(
    ctx: PromptContext,
    request_id: str,
    messages: list[dict],
    sampling: SamplingParams,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    images: list | None = None,
    add_generation_prompt: bool = True,
) -> PreparedRequest:
    """Render and tokenize a chat. ``images`` are the messages' images already loaded
    (in order); when None they are loaded here, one after another."""
    if images is None:
        budget = PixelBudget(ctx.max_pixels_per_request) if ctx.max_pixels_per_request else None
        images = [load_chat_image(ctx, ref, budget) for ref in chat_images(ctx, messages)]
    hf_messages, _ = _template_messages(messages)
    if images:
        _refuse_typed_placeholders(ctx, hf_messages)
    uses_tools = tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if uses_tools and not ctx.chat_format.handles_tools:
        hf_messages, tools = inline_tools(hf_messages, tools or []), None
    prompt = render_chat(ctx, hf_messages, tools, template_kwargs, add_generation_prompt)
    return prepare_prompt(ctx, request_id, prompt, sampling, images)


def _refuse_typed_placeholders(ctx: PromptContext, messages: list[dict]) -> None:
    """A message's text must not hold the processor's image placeholder token in a
    request with images: the processor expands the placeholders the template puts per
    image, so a typed one would stand for an image the request does not have (Gemma 3's
    processor lets it through, and the vision step then fails on the count)."""
    token = getattr(ctx.processor, "image_token", None)
    if not isinstance(token, str) or not token:
        return
    for i, message in enumerate(messages):
        content = message.get("content")
        texts = [content] if isinstance(content, str) else [
            part["text"] for part in content or [] if part.get("type") == "text"
        ]
        if any(token in text for text in texts):
            raise PromptError(f"messages[{i}] holds {token!r}, this model's image placeholder: "
                              "send images as image_url parts", f"messages[{i}].content")


def check_prompt_size(ctx: PromptContext, text_bytes: int) -> None:
    """Refuse text that cannot fit the context, before any tokenizer spends time on it."""
    limit = ctx.max_prompt_bytes
    if limit is not None and text_bytes > limit:
        raise PromptError(
            f"the prompt text ({text_bytes} bytes) cannot fit this model's context of "
            f"{ctx.max_prompt_tokens} tokens", "messages", "context_length_exceeded",
        )


def prepare_prompt(
    ctx: PromptContext,
    request_id: str,
    prompt: str,
    sampling: SamplingParams,
    images=(),
    add_special_tokens: bool | None = None,
) -> PreparedRequest:
    check_prompt_size(ctx, len(prompt.encode()))
    try:
        ids, model_inputs = tokenize(ctx, prompt, list(images), add_special_tokens)
    except (MediaError, PromptError):
        raise
    except Exception as exc:  # the processor rejected these inputs
        raise PromptError(f"could not process the request's inputs: {exc}", "messages") from exc
    if ids.size == 0:
        raise PromptError("the prompt is empty", "messages")
    return PreparedRequest(
        request_id=request_id,
        input_ids=ids,
        sampling=sampling,
        model_inputs=model_inputs,
        num_images=len(images),
        image_digests=tuple(cache_digest(im) for im in images),
        pixel_table=_pixel_table(ctx, model_inputs),
    )


def _pixel_table(ctx: PromptContext, model_inputs: dict) -> np.ndarray | None:
    """The table the request's uint8 pixels are looked up in, where they are uint8."""
    pixels = model_inputs.get("pixel_values")
    if ctx.pixel_table is None or pixels is None:
        return None
    if not packed_pixels.is_packed(pixels):
        # The image processor was checked to stop at uint8 values: floats here mean
        # the processor made them otherwise, and they cannot be taken for either kind.
        raise RuntimeError(f"{type(ctx.processor).__name__} gave float pixels where uint8 values "
                           "were asked for")
    return ctx.pixel_table
