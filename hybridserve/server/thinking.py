"""`reasoning_effort` (chat completions) and `reasoning.effort` (Responses): agent clients send them to turn a
model's thinking on or off, and the models here have a switch, not levels. "none" turns thinking off; every
other effort ("minimal" ... "xhigh") turns it on.

The switch is the chat template's, when it has one (`enable_thinking`, Qwen3-style templates: the demos'), else
the model family's: Ling-2.6 thinks when its system prompt says "detailed thinking on" (off by default), so that
line goes first in the system message (one is added when the conversation has none). A model with neither cannot
honour the field: a 400 that names it. An explicit `chat_template_kwargs.enable_thinking` that contradicts the
effort is a 400 too.
"""
from __future__ import annotations

from hybridserve.server.errors import APIError
from hybridserve.server.protocol import ChatMessage, Effort, TextMessage

LING_SWITCH = "detailed thinking {}"
_SWITCHED_BY_SYSTEM_PROMPT = ("bailing_hybrid",)  # model types whose thinking the system prompt turns on


def apply_effort(effort: Effort | None, field: str, template: str | None, model_type: str,
                 messages: list[ChatMessage], template_kwargs: dict) -> list[ChatMessage]:
    """The messages (and, in place, the template's keyword arguments) with the thinking switch set as `effort`
    (named `field` in errors) asks; `template` is the chat template's source."""
    if effort is None:
        return messages
    thinking = effort != "none"
    if "enable_thinking" in (template or ""):
        if template_kwargs.get("enable_thinking", thinking) != thinking:
            raise APIError(f"'{field}' {effort!r} contradicts chat_template_kwargs.enable_thinking="
                           f"{template_kwargs['enable_thinking']!r}; give one of them", param=field)
        template_kwargs["enable_thinking"] = thinking
        return messages
    if model_type in _SWITCHED_BY_SYSTEM_PROMPT:
        switch = LING_SWITCH.format("on" if thinking else "off")
        first = messages[0] if messages else None
        if isinstance(first, TextMessage) and first.role in ("system", "developer"):
            text = first.as_template_input()["content"]
            return [first.model_copy(update={"content": f"{switch}\n{text}"}), *messages[1:]]
        return [TextMessage(role="system", content=switch), *messages]
    raise APIError(f"'{field}' cannot be honoured: this model's chat template has no thinking switch "
                   "(enable_thinking) and its family none of its own; remove it", param=field,
                   code="unsupported_parameter")
