"""reasoning_effort / reasoning.effort set the model's thinking switch (hybridserve/server/thinking.py): a template's
enable_thinking, else Ling-2.6's system-prompt switch, else a 400 naming the field."""
from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from hybridserve.server.errors import APIError
from hybridserve.server.protocol import ChatMessage
from hybridserve.server.thinking import apply_effort

QWEN3_STYLE = "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"
MESSAGES = TypeAdapter(list[ChatMessage])


def _messages(*turns: tuple[str, str]) -> list:
    return MESSAGES.validate_python([{"role": role, "content": content} for role, content in turns])


@pytest.mark.parametrize("effort, thinking", [("none", False), ("minimal", True), ("high", True)])
def test_a_template_switch_takes_the_effort(effort, thinking):
    kwargs = {}
    messages = _messages(("user", "hi"))
    assert apply_effort(effort, "reasoning_effort", QWEN3_STYLE, "zaya", messages, kwargs) == messages
    assert kwargs == {"enable_thinking": thinking}
    with pytest.raises(APIError, match="contradicts chat_template_kwargs.enable_thinking") as caught:
        apply_effort(effort, "reasoning_effort", QWEN3_STYLE, "zaya", messages, {"enable_thinking": not thinking})
    assert caught.value.param == "reasoning_effort"


def test_ling_thinks_by_its_system_prompt():
    kwargs = {}
    with_system = apply_effort("high", "reasoning.effort", PLAIN, "bailing_hybrid",
                               _messages(("system", "Be brief."), ("user", "hi")), kwargs)
    assert [m.as_template_input() for m in with_system] == [
        {"role": "system", "content": "detailed thinking on\nBe brief."}, {"role": "user", "content": "hi"}]
    without = apply_effort("none", "reasoning.effort", PLAIN, "bailing_hybrid", _messages(("user", "hi")), kwargs)
    assert [m.as_template_input() for m in without] == [
        {"role": "system", "content": "detailed thinking off"}, {"role": "user", "content": "hi"}]
    assert kwargs == {}


def test_no_switch_is_a_400_and_no_effort_changes_nothing():
    messages = _messages(("user", "hi"))
    with pytest.raises(APIError, match="'reasoning_effort' cannot be honoured") as caught:
        apply_effort("low", "reasoning_effort", PLAIN, "zaya", messages, {})
    assert caught.value.param == "reasoning_effort"
    assert apply_effort(None, "reasoning_effort", PLAIN, "zaya", messages, {}) is messages
