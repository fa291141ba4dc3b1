"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

A chat is tokenized exactly as ``/v1/chat/completions`` would tokenize it (template,
images expanded into their image tokens), so ``count`` is the prompt's real size.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..engine.types import SamplingParams
from ..preprocess.prompt import PromptError, chat_images, check_prompt_size, prepare_chat, tokenize
from ..preprocess.tool_prompt import text_of
from .errors import bad_request
from .schemas import _check_messages, _get, _tools
from .state import AppState, read_json


async def tokenize_endpoint(request: Request) -> JSONResponse:
    state: AppState = request.app.state.vlm
    body = await read_json(request, state.config.max_request_bytes)
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise bad_request("send either 'prompt' (a string) or 'messages'", None, "missing_required_parameter")
    state.check_model(_get(body, "model", (str,)))
    ctx = state.prompt_context
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt", "invalid_type")
        add_special = _get(body, "add_special_tokens", (bool,), True)
        try:
            check_prompt_size(ctx, len(prompt.encode()))
        except PromptError as exc:
            raise bad_request(exc.message, "prompt", exc.code) from exc
        ids, _ = await state.run_cpu(tokenize, ctx, prompt, [], add_special, text_bytes=len(prompt.encode()))
    else:
        messages = _check_messages(body["messages"])
        text_bytes = sum(len(text_of(m.get("content")).encode()) for m in messages)
        try:
            check_prompt_size(ctx, text_bytes)
            refs = chat_images(ctx, messages)
        except PromptError as exc:
            raise bad_request(exc.message, exc.param, exc.code) from exc
        images = await state.load_images(refs)
        prepared = await state.run_cpu(
            prepare_chat, ctx, "tokenize", messages, SamplingParams(), _tools(body),
            _get(body, "chat_template_kwargs", (dict,), {}), images,
            _get(body, "add_generation_prompt", (bool,), True), text_bytes=text_bytes,
        )
        ids = prepared.input_ids
    tokens = [int(t) for t in ids]
    strs = [state.token_text(t) for t in tokens] if _get(body, "return_token_strs", (bool,), False) else None
    return JSONResponse({"count": len(tokens), "max_model_len": state.max_model_len,
                         "tokens": tokens, "token_strs": strs})


async def detokenize_endpoint(request: Request) -> JSONResponse:
    state: AppState = request.app.state.vlm
    body = await read_json(request, state.config.max_request_bytes)
    if not isinstance(body, dict) or "tokens" not in body:
        raise bad_request("'tokens' is required", "tokens", "missing_required_parameter")
    state.check_model(_get(body, "model", (str,)))
    tokens = body["tokens"]
    vocab = state.loaded.vocab_size
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
    ):
        raise bad_request(f"'tokens' must be an array of token ids in [0, {vocab})", "tokens")
    text = await state.run_cpu(_decode, state.loaded.tokenizer, tokens, text_bytes=len(tokens))
    return JSONResponse({"prompt": text})


def _decode(tokenizer, tokens: list[int]) -> str:
    try:
        return tokenizer.decode(tokens)
    except Exception as exc:  # ids past the tokenizer's own vocabulary (the LM head's padding)
        raise PromptError(f"could not decode 'tokens': {exc}", "tokens") from exc
