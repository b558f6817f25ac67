"""Responses-API input items become chat messages: an assistant's reasoning, text and calls form one message,
tool outputs are tool messages, and the output items the server returns can be sent back as input."""
from __future__ import annotations

import pytest

from hybridserve.server.errors import APIError
from hybridserve.server.responses_protocol import ResponsesRequest


def test_items_become_chat_messages():
    body = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Rome and Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]}]})
    messages = [m.as_template_input() for m in body.messages([])]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assistant = messages[2]
    assert assistant["content"] == "Checking." and assistant["reasoning_content"] == "Two."
    assert [(c["id"], c["function"]["arguments"]) for c in assistant["tool_calls"]] == [
        ("c1", {"city": "Rome"}), ("c2", {"city": "Oslo"})]
    assert [(m["tool_call_id"], m["content"]) for m in messages[3:]] == [("c1", "sunny"), ("c2", "rain")]


def test_earlier_turns_come_between_the_instructions_and_the_input():
    earlier = ResponsesRequest.model_validate({"input": "first"}).input_items() + [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "one"}]}]
    body = ResponsesRequest.model_validate({"input": "second", "instructions": "New rules."})
    assert [(m.role, m.content) for m in body.messages(earlier)] == [
        ("system", "New rules."), ("user", "first"), ("assistant", "one"), ("user", "second")]


def test_a_call_whose_arguments_are_not_an_object_is_a_400():
    body = ResponsesRequest.model_validate({"input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[]"}]})
    with pytest.raises(APIError, match="JSON object") as err:
        body.messages([])
    assert err.value.param == "input"
