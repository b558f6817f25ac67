"""Tool calls, reasoning and the Responses API through the official `openai` client against the demo server
(random weights, ZAYA1's tool-call format): forced calls parse into tool_calls whose arguments validate against
the tool's schema, streamed == non-streamed; a history with tool calls and results renders and runs; the Responses
API streams the event sequence the client parses and continues stored responses. The same for Ling-2.6 (its own
format, with its reasoning parser on); --tool-call-parser and chat_template_kwargs change what they should.

The tools' parameters are bounded (enums, integer ranges, booleans): a random model under a grammar closes those
in a few tokens, while a free string could run to max_tokens.
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from hybridserve.parsers.tool_calls import MAX_WHITESPACE
from tests.server.conftest import API_KEY, THINKING_ON

DEMO = "hybridserve-demo"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "metric": {"type": "boolean"}}, "required": ["city", "days"]}
PING = {"type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": PING}}]
SCHEMAS = {"get_weather": WEATHER, "ping": PING}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [  # two calls, their results, the next question
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}},
        {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": '{"loud": true}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "pong"},
    {"role": "user", "content": "Thanks. And tomorrow?"}]


@pytest.fixture(scope="module")
def client(demo_server):
    return demo_server.client()


def _streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """Tool calls assembled from streamed deltas the way OpenAI clients do (by index), the finish reason, content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ping"}}],
                         ids=["required", "named"])
def test_forced_calls_parse_validate_and_stream_the_same(client, choice):
    body = dict(model=DEMO, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                temperature=0, max_tokens=160)
    full = client.chat.completions.create(**body)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert choice == "required" or call.function.name == "ping"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, finish, content = _streamed_calls(client.chat.completions.create(**body, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_parallel_required_calls_all_validate(client):
    full = client.chat.completions.create(model=DEMO, messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=0.8, seed=7, max_tokens=240)
    calls = full.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_history_with_tool_calls_and_results_renders_and_runs(client, demo_server):
    messages = HISTORY
    rendered = demo_server.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    text = demo_server.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert ("<zyphra_tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</zyphra_tool_call>") in text
    assert "<|im_start|>user\n<zyphra_tool_response>\nsunny, 24 C\n</zyphra_tool_response>\n" \
           "<zyphra_tool_response>\npong\n</zyphra_tool_response><|im_end|>" in text
    assert '"name": "get_weather"' in text  # the offered tools are listed in the system turn
    out = client.chat.completions.create(model=DEMO, messages=messages, tools=TOOLS, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == rendered["count"] and out.choices[0].finish_reason == "length"


def test_tool_choice_none_hides_the_tools_from_the_template(demo_server):
    with_tools = demo_server.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 1})
    hidden = demo_server.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "none",
                                                            "max_tokens": 1})
    plain = demo_server.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1})
    assert hidden.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] < \
        with_tools.json()["usage"]["prompt_tokens"]


def test_chat_template_kwargs_reach_the_template_through_chat_completions(client, demo_server):
    """Qwen3's template writes an empty <think> block into the prompt when enable_thinking is false: the request's
    chat_template_kwargs must reach the template of /v1/chat/completions, not only /tokenize's."""
    prompts = {}
    for kwargs in (None, {"enable_thinking": False}):
        out = client.chat.completions.create(model=DEMO, messages=ASK, max_tokens=1, extra_body={
            "chat_template_kwargs": kwargs, "return_token_ids": True}).model_dump()
        text = demo_server.post("/detokenize", json={"tokens": out["prompt_token_ids"]}).json()["prompt"]
        rendered = demo_server.post("/tokenize", json={"messages": ASK, "chat_template_kwargs": kwargs}).json()
        assert out["usage"]["prompt_tokens"] == rendered["count"] and out["prompt_token_ids"] == rendered["tokens"]
        prompts[json.dumps(kwargs)] = text
    default, off = prompts["null"], prompts['{"enable_thinking": false}']
    assert off == default + "<think>\n\n</think>\n\n" and "<think>" not in default


# --- Ling-2.6 (the Ling demo, --reasoning-parser ling): its own tool-call format ---------------------------------

LING = "hybridserve-demo-ling"


@pytest.fixture(scope="module")
def ling_client(ling_server):
    return ling_server.client()


@pytest.mark.parametrize("choice, sampling", [
    ("required", {"temperature": 0.8, "seed": 0}),  # this seed makes two parallel calls
    ({"type": "function", "function": {"name": "ping"}}, {"temperature": 0, "parallel_tool_calls": False})],
    ids=["required-parallel", "named"])
def test_ling_forced_calls_with_reasoning_on_parse_and_stream_the_same(ling_client, ling_server, choice, sampling):
    """With a reasoning parser on, the forcing grammar lets the output reason first; the calls must still land in
    tool_calls (not reasoning_content), streamed pieces must add up to the same calls, and the gap before the first
    call is bounded (it once was not: a model could spend every token on whitespace and never call)."""
    body = dict(model=LING, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=240, **sampling)
    full = ling_client.chat.completions.create(**body, extra_body={"return_token_ids": True})
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.model_extra["reasoning_content"] is None
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert len(calls) >= 2 if choice == "required" else [name for name, _ in calls] == ["ping"]
    assert len({c.id for c in message.tool_calls}) == len(calls)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    raw = ling_server.post("/detokenize", json={"tokens": full.choices[0].model_extra["token_ids"]}).json()["prompt"]
    assert re.match(rf"[ \n\r\t]{{0,{MAX_WHITESPACE}}}<tool_call>\n", raw), raw[:300]  # Ling's format
    streamed, finish, content = _streamed_calls(ling_client.chat.completions.create(**body, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    assert all(c["id"].startswith("call_") for c in streamed) and len({c["id"] for c in streamed}) == len(calls)


def test_ling_history_with_tool_calls_and_results_renders_and_runs(ling_client, ling_server):
    """Assistant tool_calls and tool results render in Ling's (Qwen3's) format, and the conversation runs."""
    messages = HISTORY
    rendered = ling_server.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    text = ling_server.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {"loud": true}}\n</tool_call>'
            '<|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response>\n<tool_response>\npong\n" \
           "</tool_response><|im_end|>" in text
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the offered tools are listed in the system turn
    out = ling_client.chat.completions.create(model=LING, messages=messages, tools=TOOLS, max_tokens=4,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == rendered["count"] and out.choices[0].finish_reason == "length"


# --- reasoning (the guarded server runs --reasoning-parser qwen3 and trusts request templates) ---------------------

def _guarded_chat(server, **body) -> httpx.Response:
    return server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body},
                       headers={"authorization": f"Bearer {API_KEY}"})


THINKING_OFF = "{% for m in messages %}{{ m.content }}{% endfor %}<think>\n\n</think>\n\n"  # as Qwen3's off switch
ONE_OR_TWO = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}


def _json_answers(server, template: str) -> list[dict]:
    """The choices of three seeded chat requests under the ONE_OR_TWO schema, rendered by `template`."""
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": ONE_OR_TWO}}
    return [_guarded_chat(server, chat_template=template, response_format=response_format, max_tokens=12,
                          temperature=1.0, seed=seed).json()["choices"][0] for seed in range(3)]


@pytest.mark.parametrize("opens", [True, False])
def test_a_json_schema_answer_follows_the_reasoning_instead_of_becoming_it(guarded_server, opens):
    """With a reasoning parser a request's own grammar applies after the reasoning (ReasoningFormat.lead). A prompt
    that opens <think>: the output reasons freely first, and the schema's JSON is never forced into
    reasoning_content, as it was when the grammar began at the first token (finish "stop", the JSON as
    reasoning_content, content empty). Either the block closes and the content is the schema's JSON, or the
    reasoning runs to max_tokens. A prompt that opens none: an optional block, then the same JSON."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}" + ("<think>\n" if opens else "")
    for choice in _json_answers(guarded_server, template):
        content, reasoning = choice["message"]["content"], choice["message"]["reasoning_content"]
        if content:
            jsonschema.validate(json.loads(content), ONE_OR_TWO)
        else:
            assert choice["finish_reason"] == "length" and reasoning, choice
        if opens:
            assert reasoning and not reasoning.lstrip().startswith('{"n"'), choice


def test_with_thinking_off_a_json_schema_answer_starts_at_once(guarded_server):
    """A prompt that closes its reasoning block (Qwen3's enable_thinking=False writes an empty one): no reasoning
    may come first, the grammar holds from the first token, so even a random model answers with the JSON."""
    for choice in _json_answers(guarded_server, THINKING_OFF):
        assert choice["finish_reason"] == "stop" and choice["message"]["reasoning_content"] is None, choice
        jsonschema.validate(json.loads(choice["message"]["content"]), ONE_OR_TWO)


def test_reasoning_opened_by_the_prompt_goes_to_reasoning_content(guarded_server):
    """A template that opens <think> in the generation prompt: the whole (never closed) output is reasoning,
    streamed and not; without the open block the same parser leaves everything in the content."""
    opening = "{% for m in messages %}{{ m.content }}{% endfor %}<think>\n"
    body = dict(chat_template=opening, max_tokens=6, temperature=0, ignore_eos=True)
    full = _guarded_chat(guarded_server, **body).json()["choices"][0]["message"]
    assert full["content"] == "" and full["reasoning_content"]
    events = _sse(guarded_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "stream": True, **body})
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == full["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    closed = _guarded_chat(guarded_server, chat_template="{{ messages[0].content }}<think></think>", max_tokens=6,
                           temperature=0, ignore_eos=True).json()["choices"][0]["message"]
    assert closed["reasoning_content"] is None and closed["content"]


def test_the_tool_call_parser_flag_replaces_the_model_types_format(guarded_server):
    """The guarded server runs the ZAYA1 demo with --tool-call-parser ling: an output pinned (by guided_choice) to a
    call in Ling's format is parsed into tool_calls, the same call in ZAYA1's own format stays content. (The calls
    take no arguments: spelled out by a random model they must fit the 48-token context.) The prompt closes its
    reasoning block (thinking off), so the pinned output starts at the first token."""
    ping = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
    ling = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    zaya = "<zyphra_tool_call>\n<function=ping>\n</function>\n</zyphra_tool_call>"
    choices = {}
    for text in (ling, zaya):
        response = _guarded_chat(guarded_server, tools=ping, guided_choice=[text], max_tokens=40, temperature=0,
                                 chat_template=THINKING_OFF)  # no reasoning lead: the choice from the first token
        assert response.status_code == 200, response.text
        choices[text] = response.json()["choices"][0]
    assert choices[ling]["finish_reason"] == "tool_calls" and choices[ling]["message"]["content"] is None
    (call,) = choices[ling]["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("ping", "{}")
    assert choices[zaya]["finish_reason"] == "stop" and choices[zaya]["message"]["content"] == zaya
    assert "tool_calls" not in choices[zaya]["message"]


def _sse(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120,
                      headers={"authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        raw = response.read().decode()
    return [json.loads(line.removeprefix("data: ")) for line in raw.splitlines()
            if line.startswith("data: {")]


# --- Responses API ------------------------------------------------------------------------------------------------

RESPONSE_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                  for t in TOOLS]


def test_responses_text_streamed_and_not(client):
    body = dict(model=DEMO, input="Say hello.", instructions="Be brief.", max_output_tokens=8, temperature=0)
    full = client.responses.create(**body)
    assert full.object == "response" and full.status == "incomplete"
    assert full.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in full.output] == ["message"] and full.output_text
    assert full.usage.output_tokens == 8 and full.usage.output_tokens_details.reasoning_tokens == 0
    events = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    assert events[-1].response.output_text == full.output_text and events[-1].response.id != full.id


def test_responses_tool_call_then_continue_from_the_stored_response(client, demo_server):
    body = dict(model=DEMO, input="What is the weather in Rome?", tools=RESPONSE_TOOLS, tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=160, temperature=0)
    first = client.responses.create(**body)
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(**body) as stream:  # the client's own accumulator accepts the event sequence
        streamed = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in streamed.output] == [(call.type, call.name, call.arguments)]
    follow = client.responses.create(model=DEMO, previous_response_id=first.id, max_output_tokens=3, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "22 C"}])
    assert follow.previous_response_id == first.id
    called = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    history = [{"role": "user", "content": "What is the weather in Rome?"},
               {"role": "assistant", "content": None, "tool_calls": [called]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "22 C"}]
    assert follow.usage.input_tokens == demo_server.post("/tokenize", json={"messages": history}).json()["count"]
    again = client.responses.retrieve(follow.id)
    assert again.id == follow.id and again.output_text == follow.output_text
    missing = demo_server.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(f"{demo_server.url}/v1/responses/resp_nope").status_code == 404


def test_responses_json_schema_output_streamed_and_not(client):
    """text.format json_schema constrains the output of both modes; the streamed deltas and the client's
    accumulated response give the same valid JSON as the non-streamed call."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    body = dict(model=DEMO, input="Give JSON.", max_output_tokens=40, temperature=0,
                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    out = client.responses.create(**body)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), schema)
    with client.responses.stream(**body) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        streamed = stream.get_final_response()
    assert streamed.status == "completed" and streamed.output_text == deltas == out.output_text
    assert streamed.text.format.type == "json_schema"


def test_responses_reasoning_item_and_events(guarded_server):
    """With a reasoning parser, an output inside a reasoning block (the operator template opens one for THINKING_ON
    instructions) becomes a reasoning item of reasoning_text, streamed as reasoning_text events the client parses,
    and its tokens are counted as reasoning tokens."""
    client = guarded_server.client(API_KEY)
    body = dict(model=DEMO, input="hi", instructions=THINKING_ON, max_output_tokens=6, temperature=0)
    full = client.responses.create(**body)
    assert full.status == "incomplete" and full.output_text == ""
    (item,) = full.output
    assert item.type == "reasoning" and item.summary == [] and item.id.startswith("rs_")
    (part,) = item.content
    assert part.type == "reasoning_text" and part.text
    assert full.usage.output_tokens == full.usage.output_tokens_details.reasoning_tokens == 6
    events = list(client.responses.create(**body, stream=True))  # the client parses every event
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    assert "response.output_text.delta" not in kinds and kinds[-4:] == [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == part.text
    assert events[-4].text == part.text and events[-1].response.output[0].content[0].text == part.text
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 6
