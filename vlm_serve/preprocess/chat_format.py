"""How a model's chat template wants its messages, found out once by rendering probes.

Templates disagree on message content: some read only a string (and fail on a list),
some read only a list of parts (and silently drop a string), some want images written
into the text as numbered placeholders. Rather than trust a table, the server renders a
few probe messages at startup and keeps the shapes that carry the user's words through.
A checkpoint with no template at all gets mlx-vlm's own prompt formatting.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_prompt import text_of

_PROBE = "zq7 probe words"
# A function no template mentions unless it renders the tools it is given.
_PROBE_TOOL = {"type": "function", "function": {
    "name": "vlm_serve_probe_function", "description": "Probe.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
}}
# Families whose templates take images as numbered placeholders inside string content.
_NUMBERED_IMAGES = {"phi3_v": "<|image_{n}|>\n", "phi4mm": "<|image_{n}|>\n"}


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class ChatFormat:
    template: str | None  # None: the checkpoint has no chat template
    model_type: str = ""
    list_roles: frozenset = frozenset()  # roles whose text content must be a list of parts
    images_as_text: bool = False  # images go into string content as placeholders
    variables: frozenset = frozenset()  # names the template reads from its context
    handles_tools: bool = False  # the template renders the request's tools itself

    @classmethod
    def detect(cls, tokenizer, template: str | None, model_type: str = "") -> "ChatFormat":
        if not template:
            return cls(None, model_type)

        def renders(messages) -> str | None:
            try:
                text = _apply(tokenizer, template, messages)
            except Exception:  # noqa: BLE001 - a template that cannot take this shape
                return None
            return text if _PROBE in text else None

        def in_turn(role: str, content) -> list[dict]:
            probe = {"role": role, "content": content}
            if role == "user":
                return [probe]
            if role == "system":
                return [probe, {"role": "user", "content": "Hi."}]
            return [{"role": "user", "content": "Hi."}, probe, {"role": "user", "content": "Go on."}]

        list_roles = set()
        for role in ("user", "system", "assistant"):
            if renders(in_turn(role, _PROBE)) is None:
                if renders(in_turn(role, [{"type": "text", "text": _PROBE}])) is not None:
                    list_roles.add(role)
                elif role == "user":
                    raise TemplateError("the chat template drops the text of user messages in any shape")
        user = in_turn("user", _PROBE if "user" not in list_roles else [{"type": "text", "text": _PROBE}])
        try:  # a template that knows tools writes their definitions into the prompt
            handles_tools = _PROBE_TOOL["function"]["name"] in _apply(
                tokenizer, template, user, tools=[_PROBE_TOOL]
            )
        except Exception:  # noqa: BLE001 - a template that cannot take tools
            handles_tools = False
        as_list = renders([{"role": "user", "content": [{"type": "text", "text": _PROBE}]}])
        with_image = renders([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _PROBE}]}])
        return cls(
            template,
            model_type,
            list_roles=frozenset(list_roles),
            images_as_text=with_image is None or with_image == as_list,
            variables=template_variables(template),
            handles_tools=handles_tools,
        )

    def shape(self, messages: list[dict]) -> list[dict]:
        """Messages with content in the shapes this template renders."""
        out, image_number = [], 0
        for msg in messages:
            content = msg.get("content")
            if isinstance(content, list) and self.images_as_text:
                text = ""
                for part in content:
                    if part.get("type") == "image":
                        image_number += 1
                        text += self._image_text(image_number)
                    else:
                        text += part.get("text", "")
                content = text
            if isinstance(content, str) and msg["role"] in self.list_roles:
                content = [{"type": "text", "text": content}] if content else []
            out.append({**msg, "content": content})
        return out

    def _image_text(self, n: int) -> str:
        return _NUMBERED_IMAGES.get(self.model_type, "<image>\n").format(n=n)

    def render(self, processor, messages: list[dict], template: str | None = None, **kwargs) -> str:
        """The prompt for ``messages``; ``template`` overrides the model's own."""
        tokenizer = getattr(processor, "tokenizer", processor)
        template = template or self.template
        if template is None:
            return _without_template(processor, self.model_type, messages)
        return _apply(tokenizer, template, self.shape(messages), **kwargs)


def template_variables(template: str) -> frozenset:
    """The names a template reads from its context (``enable_thinking``, ``date_string``...)."""
    from jinja2 import Environment, meta

    try:
        return frozenset(meta.find_undeclared_variables(Environment().parse(template)))
    except Exception:  # noqa: BLE001 - a template jinja2 cannot parse offers no variables
        return frozenset()


def processor_template(processor) -> str | None:
    """The template a processor (or its tokenizer) carries, if any."""
    for owner in (processor, getattr(processor, "tokenizer", None)):
        template = getattr(owner, "chat_template", None)
        if isinstance(template, str) and template:
            return template
    return None


def _apply(tokenizer, template: str, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def _without_template(processor, model_type: str, messages: list[dict]) -> str:
    """mlx-vlm's own prompt for a checkpoint that ships no template (e.g. PaliGemma:
    its prompt is the last user message, image tokens first; the processor adds the
    rest)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    user = [m for m in messages if m["role"] == "user"]
    if not user:
        raise TemplateError("this model has no chat template; send a user message")
    content = user[-1].get("content")
    images = sum(1 for p in content if p.get("type") == "image") if isinstance(content, list) else 0
    prompt = apply_chat_template(
        processor, {"model_type": model_type}, text_of(content), num_images=images
    )
    if isinstance(prompt, dict):
        prompt = prompt.get("content", "")
    if not isinstance(prompt, str):
        raise TemplateError(f"this model has no chat template and mlx-vlm cannot format {model_type!r} prompts")
    return prompt
