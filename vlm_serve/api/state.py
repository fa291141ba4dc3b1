"""What request handlers share: the engine, the config, the CPU pool."""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import Request

from ..config import ServerConfig
from ..engine.engine import Engine, EngineBusy, RequestStream
from ..engine.types import PreparedRequest
from ..preprocess.image_cache import ImageCache
from ..preprocess.media import MediaError, MediaPolicy, PixelBudget
from ..preprocess.prompt import PromptContext, PromptError
from .errors import APIError, bad_request
from .schemas import decode_json
from .metrics import Metrics
from ..tools import detect_parser, get_parser, tool_signatures
from .output import OutputProcessor
from .reasoning import GEMMA4


class AppState:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.loaded = engine.loaded
        self.model_id = config.model_id
        self.max_model_len = config.max_model_len or self.loaded.max_model_len
        self.cpu_pool = ThreadPoolExecutor(config.cpu_workers, thread_name_prefix="vlm-cpu")
        # Large prompts render and tokenize here, one at a time, so they never hold the
        # threads that every small request needs.
        self.large_pool = ThreadPoolExecutor(1, thread_name_prefix="vlm-cpu-large")
        # Image fetching and decoding have threads of their own: slow image URLs never
        # stall requests without images.
        self.media_pool = ThreadPoolExecutor(4 * config.cpu_workers, thread_name_prefix="vlm-media")
        self.prompt_context = PromptContext(
            processor=self.loaded.processor,
            model_type=self.loaded.model_type,
            media=MediaPolicy(
                max_image_bytes=config.max_image_bytes,
                max_image_pixels=config.max_image_pixels,
                fetch_timeout_s=config.media_fetch_timeout_s,
                allow_private_urls=config.allow_private_media_urls,
                allowed_local_path=config.allowed_local_media_path,
                min_image_pixels=config.min_image_pixels,
            ),
            max_images=config.limit_mm_per_prompt,
            chat_template=self.loaded.chat_template,
            max_prompt_tokens=self.max_model_len,
            trust_request_template=config.trust_request_chat_template,
            max_pixels_per_request=config.max_pixels_per_request,
            image_cache=ImageCache(config.image_cache_size, int(config.image_cache_gb * 2**30)),
        )
        self.started = int(time.time())
        fmt = config.tool_call_parser or detect_parser(self.loaded.chat_template, self.loaded.model_type)
        if fmt is None and not self.prompt_context.chat_format.handles_tools:
            fmt = "gemma3"  # such templates get the tool_code prompt: parse what it asks for
        self.tool_parser = get_parser(fmt) if fmt else None
        self.reasoning = GEMMA4 if self.loaded.model_type.startswith("gemma4") else None
        self.metrics = Metrics(lambda: engine.scheduler.stats(), self.model_id,
                               self.prompt_context.image_cache)
        self.heartbeat_s = 5.0
        self._token_texts: dict[int, str] = {}

    def output_processor(self, chat) -> OutputProcessor:
        tools = None
        if chat.active_tools and self.tool_parser is not None:
            tools = self.tool_parser.streaming(tool_signatures(chat.active_tools))
        return OutputProcessor(self.reasoning, tools)

    async def run_cpu(self, fn, *args, text_bytes: int = 0):
        """Run CPU-bound preprocessing on the pool (the large-prompt lane for text over
        ``LARGE_PROMPT_BYTES``); client-caused failures become 400s."""
        pool = self.large_pool if text_bytes > LARGE_PROMPT_BYTES else self.cpu_pool
        return await _client_errors(asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args)))

    async def load_images(self, refs: list[tuple[str, str, str | None]]) -> list:
        """Fetch and decode a request's images concurrently on the media pool, within its
        pixel budget."""
        from ..preprocess.prompt import load_chat_image

        ctx = self.prompt_context
        budget = PixelBudget(ctx.max_pixels_per_request) if ctx.max_pixels_per_request else None
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self.media_pool, load_chat_image, ctx, ref, budget) for ref in refs]
        return await _client_errors(asyncio.gather(*jobs))

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_id, self.config.model):
            raise APIError(
                400, f"model {model!r} is not served here (serving {self.model_id!r})",
                param="model", code="model_not_found",
            )

    def apply_limits(self, prepared: PreparedRequest, max_tokens: int | None) -> None:
        """Fill in the default max_tokens and refuse prompts that cannot fit."""
        prompt = prepared.num_prompt_tokens
        room = self.max_model_len - prompt
        if room < 1:
            raise bad_request(
                f"the prompt has {prompt} tokens, over this model's context of "
                f"{self.max_model_len}", "messages", "context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, room)
        elif max_tokens > room:
            raise bad_request(
                f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                f"context of {self.max_model_len} tokens", "max_tokens", "context_length_exceeded",
            )
        prepared.sampling.max_tokens = max_tokens
        if self.config.request_timeout_s:
            prepared.deadline = time.monotonic() + self.config.request_timeout_s

    def submit(self, prepared: PreparedRequest) -> RequestStream:
        try:
            return self.engine.submit(prepared)
        except EngineBusy as exc:
            raise APIError(
                503, "the server is at capacity; retry shortly", code="server_busy",
                headers={"Retry-After": "1"},
            ) from exc

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.loaded.tokenizer.decode([token_id])
        return text


# Prompts with more text than this are rendered and tokenized in the large-prompt lane.
LARGE_PROMPT_BYTES = 64 * 1024


async def _client_errors(work):
    try:
        return await work
    except (MediaError, PromptError) as exc:
        raise bad_request(exc.message, exc.param, exc.code) from exc


async def read_json(request: Request, limit: int):
    """The request body as JSON, refusing bodies over ``limit`` bytes (413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    # Refuses non-finite numbers and deep nesting too (400s naming the field).
    return decode_json(b"".join(chunks))
