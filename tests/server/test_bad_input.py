"""Bad input gets a 4xx with an OpenAI-style body that says what to change, and harms nobody else's request.

CASES holds the hand matrix, including every reproducer of issue 9 (each once crashed the server, exhausted it or
was silently accepted with a wrong meaning); WORKS holds the inputs that must simply work.
"""
from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

DEMO = "hybridserve-demo"
OK = {"model": DEMO, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def tool_def(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


SURROGATE_PROMPT = b'{"prompt": "ab\\ud800cd", "max_tokens": 4}'

# (case, path, body (raw bytes are sent as they are), status, param, a word the message must contain)
CASES = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', 400, None, "JSON"),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None, "object"),
    ("missing prompt", "/v1/completions", {"model": DEMO}, 400, "prompt", "prompt"),
    ("prompt of a wrong type", "/v1/completions", {**OK, "prompt": {"text": "x"}}, 400, "prompt", "string"),
    ("max_tokens of a wrong type", "/v1/completions", {**OK, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("negative max_tokens", "/v1/completions", {**OK, "max_tokens": -5}, 400, "max_tokens", "max_tokens"),
    ("zero max_tokens", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("absurd max_tokens", "/v1/completions", {**OK, "max_tokens": 10**12}, 400, "max_tokens", "context length"),
    ("max_tokens past int64", "/v1/completions", {**OK, "max_tokens": 2**64}, 400, "max_tokens", "less than"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "empty"),
    ("empty prompt list", "/v1/completions", {**OK, "prompt": []}, 400, "prompt", "empty"),
    ("empty token list in a batch", "/v1/completions", {**OK, "prompt": [[1, 2], []]}, 400, "prompt", "empty"),
    ("prompt longer than the context", "/v1/completions", {**OK, "prompt": [11] * 5000}, 400, "prompt",
     "context length"),
    ("token id out of the vocabulary", "/v1/completions", {**OK, "prompt": [1, 2, 10**7]}, 400, "prompt",
     f"Token id {10**7} is out of vocabulary"),  # vLLM's words, which its clients match
    ("negative token id", "/v1/completions", {**OK, "prompt": [-1]}, 400, "prompt", "integers >= 0"),
    ("token id past int64", "/v1/completions", {**OK, "prompt": [2**63]}, 400, "prompt", "token ids"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-9"}, 404, "model", "does not exist"),
    ("stop of a wrong type", "/v1/completions", {**OK, "stop": 5}, 400, "stop", "string"),
    ("stop list with a number", "/v1/completions", {**OK, "stop": ["a", 1]}, 400, "stop", "string"),
    ("empty stop string", "/v1/completions", {**OK, "stop": [""]}, 400, "stop", "non-empty"),
    ("too many stop strings", "/v1/completions", {**OK, "stop": ["x"] * 33}, 400, "stop", "at most 32"),
    ("negative temperature", "/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature",
     "greater than or equal to 0"),
    ("temperature above 2", "/v1/completions", {**OK, "temperature": 2.5}, 400, "temperature", "less than or equal"),
    ("temperature as text", "/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", "number"),
    # issue 9 #6: Infinity was accepted
    ("temperature Infinity", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4, "temperature": Infinity}', 400,
     "temperature", "finite"),
    ("top_p NaN", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4, "top_p": NaN}', 400, "top_p", "finite"),
    ("top_p of 0", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "greater than 0"),
    ("top_p above 1", "/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("n = 0", "/v1/completions", {**OK, "n": 0}, 400, "n", "greater than or equal to 1"),
    ("absurd n", "/v1/completions", {**OK, "n": 10**9}, 400, "n", "--max-n"),
    # issue 9 #2: prompts x n is bounded per request (--max-n, 256 by default)
    ("prompts x n over --max-n", "/v1/completions", {**OK, "prompt": ["a", "b", "c"], "n": 100}, 400, "n",
     "--max-n"),
    ("64 two-token prompts x n=128 (once a host OOM)", "/v1/completions",
     {**OK, "prompt": [[1, 2]] * 64, "n": 128, "max_tokens": 64, "temperature": 0.7}, 400, "n", "--max-n"),
    ("logprobs above 20", "/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs", "20"),
    ("echo of a wrong type", "/v1/completions", {**OK, "echo": "yes"}, 400, "echo", "boolean"),
    ("logit_bias above 100", "/v1/completions", {**OK, "logit_bias": {"5": 100.5}}, 400, "logit_bias",
     "less than or equal to 100"),
    ("logit_bias keyed by a word", "/v1/completions", {**OK, "logit_bias": {"five": 1}}, 400, "logit_bias",
     "token ids"),
    ("logit_bias outside the vocabulary", "/v1/chat/completions", {**CHAT, "logit_bias": {"10000000": -100}}, 400,
     "logit_bias", "vocabulary"),
    ("chat top_logprobs above --max-logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", "--max-logprobs"),
    ("SGLang's regex beside response_format", "/v1/chat/completions",
     {**CHAT, "regex": "[a-z]+", "response_format": {"type": "json_object"}}, 400, "regex", "at most one"),
    ("SGLang's ebnf that does not compile", "/v1/completions", {**OK, "ebnf": "root ::= "}, 400, "ebnf",
     "cannot be compiled"),
    # issue 9 #1: these crashed the engine thread (and with it the server)
    ("tiny repetition_penalty", "/v1/completions", {**OK, "repetition_penalty": 1e-200}, 400, "repetition_penalty",
     "greater than or equal to 0.01"),
    ("stop id out of the vocabulary with min_tokens", "/v1/completions",
     {**OK, "min_tokens": 1, "stop_token_ids": [200000]}, 400, "stop_token_ids", "vocabulary"),
    ("stop id past int64", "/v1/completions", {**OK, "stop_token_ids": [2**63]}, 400, "stop_token_ids", "less than"),
    ("top_k past int64", "/v1/completions", {**OK, "top_k": 2**63}, 400, "top_k", "less than"),
    # issue 9 #5: a lone surrogate was a 500 that dropped the connection
    ("lone surrogate in a prompt", "/v1/completions", SURROGATE_PROMPT, 400, "prompt", "surrogate"),
    ("lone surrogate in /tokenize", "/tokenize", b'{"prompt": "ab\\ud800cd"}', 400, "prompt", "surrogate"),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}', 400, "messages", "surrogate"),
    ("lone surrogate in a stop string", "/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}', 400, "stop",
     "surrogate"),
    # issue 9 #6: accepted but wrong
    ("seed past int64", "/v1/completions", {**OK, "seed": 2**70}, 400, "seed", "less than"),
    ("stream_options without stream", "/v1/completions", {**OK, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream"),
    ("best_of 2", "/v1/completions", {**OK, "best_of": 2}, 400, "best_of", "not supported"),
    # issue 13: structured output (a grammar that cannot be compiled, conflicting or malformed constraints)
    ("uncompilable guided_json", "/v1/completions", {**OK, "guided_json": {"type": "foo"}}, 400, "guided_json",
     'cannot be compiled: Unsupported type "foo"'),
    # streamed: the grammar is compiled before the stream starts, so the error is a 4xx, not an error event
    ("streamed uncompilable guided_json", "/v1/completions", {**OK, "stream": True, "guided_json": {"type": "foo"}},
     400, "guided_json", 'cannot be compiled: Unsupported type "foo"'),
    ("streamed chat json_schema with a dangling $ref", "/v1/chat/completions", {**CHAT, "stream": True,
     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}}, 400,
     "response_format", "cannot be compiled"),
    ("streamed chat grammar with an undefined rule", "/v1/chat/completions",
     {**CHAT, "stream": True, "guided_grammar": "root ::= nowhere"}, 400, "guided_grammar", "is not defined"),
    ("streamed completion regex that cannot compile", "/v1/completions",
     {**OK, "stream": True, "stream_options": {"include_usage": True}, "guided_regex": "(ab"}, 400, "guided_regex",
     "cannot be compiled"),
    ("guided_json that is not JSON", "/v1/completions", {**OK, "guided_json": "{oops"}, 400, "guided_json",
     "not valid JSON text"),
    ("json_schema with a dangling $ref", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, 400,
     "response_format", "cannot be compiled"),
    ("json_schema without a schema", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format",
     "json_schema.schema"),
    ("unknown response_format type", "/v1/completions", {**OK, "response_format": {"type": "yaml"}}, 400,
     "response_format", "'json_schema'"),
    ("invalid regex", "/v1/completions", {**OK, "guided_regex": "(ab"}, 400, "guided_regex", "cannot be compiled"),
    ("regex that cannot match", "/v1/chat/completions", {**CHAT, "guided_regex": "[^\\s\\S]"}, 400,
     "guided_regex", "matches no text"),
    ("empty guided_choice", "/v1/completions", {**OK, "guided_choice": []}, 400, "guided_choice", "1 to 1024"),
    ("grammar with an undefined rule", "/v1/completions", {**OK, "guided_grammar": "root ::= nowhere"}, 400,
     "guided_grammar", 'Rule "nowhere" is not defined'),
    ("two output constraints", "/v1/chat/completions",
     {**CHAT, "guided_choice": ["a"], "response_format": {"type": "json_object"}}, 400, "guided_choice",
     "at most one output constraint"),
    ("structured_outputs with two kinds", "/v1/completions",
     {**OK, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs", "exactly one"),
    ("min_tokens beside a grammar", "/v1/completions", {**OK, "guided_regex": "a+", "min_tokens": 2}, 400,
     "min_tokens", "grammar decides"),
    ("guided_decoding_backend", "/v1/completions", {**OK, "guided_regex": "a+", "guided_decoding_backend": "outlines"},
     400, "guided_decoding_backend", "not supported"),
    # issue 13: vLLM extras
    ("streamed prompt_logprobs", "/v1/completions", {**OK, "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs", "stream"),
    ("streamed chat prompt_logprobs", "/v1/chat/completions", {**CHAT, "prompt_logprobs": 0, "stream": True}, 400,
     "prompt_logprobs", "stream"),
    ("prompt_logprobs above 20", "/v1/completions", {**OK, "prompt_logprobs": 21}, 400, "prompt_logprobs", "20"),
    ("return_token_ids of a wrong type", "/v1/completions", {**OK, "return_token_ids": "yes"}, 400,
     "return_token_ids", "boolean"),
    ("continuous_usage_stats of a wrong type", "/v1/completions",
     {**OK, "stream": True, "stream_options": {"continuous_usage_stats": 1}}, 400, "stream_options", "boolean"),
    ("suffix", "/v1/completions", {**OK, "suffix": "end"}, 400, "suffix", "not supported"),
    # issue 34: vLLM's prompt truncation and logprob fields
    ("truncate_prompt_tokens below -1", "/v1/completions", {**OK, "truncate_prompt_tokens": -2}, 400,
     "truncate_prompt_tokens", "greater than or equal to -1"),
    ("truncate_prompt_tokens past the context", "/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": 10**6},
     400, "truncate_prompt_tokens", "context length"),
    ("truncate_prompt_tokens of 0", "/v1/completions", {**OK, "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens", "empty prompt"),
    ("truncation_side of no known side", "/v1/completions",
     {**OK, "truncate_prompt_tokens": 2, "truncation_side": "middle"}, 400, "truncation_side", "'left'"),
    ("return_tokens_as_token_ids of a wrong type", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "return_tokens_as_token_ids": 1}, 400, "return_tokens_as_token_ids", "boolean"),
    ("logprob_token_ids without logprobs", "/v1/completions", {**OK, "logprob_token_ids": [1, 2]}, 400,
     "logprob_token_ids", "needs logprobs"),
    ("chat logprob_token_ids with logprobs false", "/v1/chat/completions",
     {**CHAT, "logprobs": False, "logprob_token_ids": [1]}, 400, "logprob_token_ids", "needs logprobs"),
    ("logprob_token_ids out of the vocabulary", "/v1/completions",
     {**OK, "logprobs": 1, "logprob_token_ids": [1, 10**7]}, 400, "logprob_token_ids",
     f"Token id {10**7} is out of vocabulary"),
    ("negative logprob_token_ids", "/v1/chat/completions", {**CHAT, "logprobs": True, "logprob_token_ids": [-1]},
     400, "logprob_token_ids", "greater than or equal to 0"),
    ("more than 128 logprob_token_ids", "/v1/completions",
     {**OK, "logprobs": 0, "logprob_token_ids": list(range(129))}, 400, "logprob_token_ids", "128"),
    ("SGLang's custom_logit_processor", "/v1/chat/completions", {**CHAT, "custom_logit_processor": "{}"}, 400,
     "custom_logit_processor", "not supported"),
    ("SGLang's custom_params", "/v1/completions", {**OK, "custom_params": {"k": 1}}, 400, "custom_params",
     "not supported"),
    ("role hacker", "/v1/chat/completions", {**CHAT, "messages": [{"role": "hacker", "content": "hi"}]}, 400,
     "messages", "'user'"),
    ("role wizard", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages", "'assistant'"),
    ("tool message without tool_call_id", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "tool", "content": "42"}]}, 400, "messages", "tool_call_id"),
    ("user content null", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, 400,
     "messages", "string"),
    ("tool_calls whose arguments are not a JSON object", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400, "messages",
     "JSON object"),
    ("tool_calls on a user message", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hi", "tool_calls": [
         {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages",
     "tool_calls"),
    ("reasoning_effort of no known level", "/v1/chat/completions", {**CHAT, "reasoning_effort": "extreme"}, 400,
     "reasoning_effort", "'none'"),
    ("reasoning_effort against enable_thinking", "/v1/chat/completions",
     {**CHAT, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, 400, "reasoning_effort",
     "contradicts"),
    ("responses reasoning summary other than auto", "/v1/responses",
     {"input": "hi", "reasoning": {"effort": "low", "summary": "detailed"}}, 400, "reasoning", "'auto'"),
    ("continue_final_message after a user message", "/v1/chat/completions", {**CHAT, "continue_final_message": True},
     400, "continue_final_message", "assistant message last"),
    ("tool without a name", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {}}]}, 400,
     "tools", "name"),
    ("tool name with a space", "/v1/chat/completions", {**CHAT, "tools": [tool_def("get weather")]}, 400, "tools",
     "match pattern"),
    ("tool parameters not an object schema", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, 400,
     "tools", "object"),
    ("tool of another type", "/v1/chat/completions", {**CHAT, "tools": [{"type": "web_search"}]}, 400, "tools",
     "'function'"),
    ("the same tool twice", "/v1/chat/completions", {**CHAT, "tools": [tool_def("f"), tool_def("f")]}, 400, "tools",
     "unique"),
    ("tool_choice naming an unknown function", "/v1/chat/completions",
     {**CHAT, "tools": [tool_def("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice", "not among the tools"),
    ("tool_choice required without tools", "/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400,
     "tool_choice", "needs tools"),
    ("tool_choice of a wrong value", "/v1/chat/completions",
     {**CHAT, "tools": [tool_def("f")], "tool_choice": "always"}, 400, "tool_choice", "required"),
    ("parallel_tool_calls as text", "/v1/chat/completions", {**CHAT, "parallel_tool_calls": "yes"}, 400,
     "parallel_tool_calls", "boolean"),
    ("forced call of a tool whose schema cannot be compiled", "/v1/chat/completions",
     {**CHAT, "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}]}, 400, "tools", "cannot be compiled"),
    ("forced tool call with min_tokens", "/v1/chat/completions",
     {**CHAT, "tools": [tool_def("f")], "tool_choice": "required", "min_tokens": 2}, 400, "min_tokens", "structured"),
    ("responses without input", "/v1/responses", {"model": DEMO}, 400, "input", "required"),
    ("responses with an empty input list", "/v1/responses", {"input": []}, 400, "input", "at least 1"),
    ("responses input item of an unknown type", "/v1/responses", {"input": [{"type": "computer_call"}]}, 400,
     "input", "computer_call"),
    ("responses image input", "/v1/responses",
     {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input",
     "input_text"),
    ("responses function_call whose arguments are not an object", "/v1/responses",
     {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, 400, "input",
     "JSON object"),
    ("responses unknown previous_response_id", "/v1/responses", {"input": "hi", "previous_response_id": "resp_x"},
     400, "previous_response_id", "no stored response"),
    ("responses json_schema without a schema", "/v1/responses",
     {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text", "schema"),
    ("responses uncompilable json_schema", "/v1/responses",
     {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, 400,
     "text", 'cannot be compiled: Unsupported type "foo"'),
    ("streamed responses json_schema with a dangling $ref", "/v1/responses", {"input": "hi", "stream": True,
     "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, 400, "text",
     "cannot be compiled"),
    ("responses web_search tool", "/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools",
     "'function'"),
    ("responses tool_choice naming an unknown function", "/v1/responses",
     {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     400, "tool_choice", "not among the tools"),
    ("responses reasoning effort of no known level", "/v1/responses", {"input": "hi", "reasoning": {"effort": "max"}},
     400, "reasoning", "'none'"),
    ("responses max_output_tokens of 0", "/v1/responses", {"input": "hi", "max_output_tokens": 0}, 400,
     "max_output_tokens", "greater than or equal to 1"),
    ("responses unknown model", "/v1/responses", {"input": "hi", "model": "gpt-9"}, 404, "model", "does not exist"),
    ("chat echo", "/v1/chat/completions", {**CHAT, "echo": True}, 400, "echo", "not supported"),
    ("chat best_of", "/v1/chat/completions", {**CHAT, "best_of": 3}, 400, "best_of", "not supported"),
    # issue 9 #3: a request may not replace the model's chat template unless the operator allows it
    ("chat_template in chat_template_kwargs", "/v1/chat/completions",
     {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, 400, "chat_template",
     "--trust-request-chat-template"),
    ("chat_template field", "/v1/chat/completions", {**CHAT, "chat_template": "{{ 'x' }}"}, 400, "chat_template",
     "--trust-request-chat-template"),
    ("chat_template in /tokenize", "/tokenize", {"messages": CHAT["messages"], "chat_template": "{{ 'x' }}"}, 400,
     "chat_template", "--trust-request-chat-template"),
    ("template call parameter as a template variable", "/v1/chat/completions",
     {**CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs", "tokenize"),
    ("no messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "at least 1"),
    ("message content of a wrong type", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages", "string"),
    ("image content part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages", "text"),
    ("top_logprobs above 20", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, 400,
     "top_logprobs", "20"),
    ("chat max_completion_tokens too large", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**6},
     400, "max_completion_tokens", "context length"),
    # issue 9 #6: chat errors name the fields the request used
    ("min_tokens above max_completion_tokens", "/v1/chat/completions",
     {**CHAT, "max_tokens": None, "max_completion_tokens": 3, "min_tokens": 5}, 400, "min_tokens",
     "must not exceed max_completion_tokens"),
    ("detokenize ids out of the vocabulary", "/detokenize", {"tokens": [10**9]}, 400, "tokens",
     f"Token id {10**9} is out of vocabulary"),
    ("detokenize a negative id", "/detokenize", {"tokens": [-3]}, 400, "tokens", "greater than or equal to 0"),
    ("tokenize both prompt and messages", "/tokenize", {"prompt": "x", "messages": CHAT["messages"]}, 400,
     "prompt", "exactly one"),
]


def _send(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    if isinstance(body, bytes):
        return server.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})
    return server.post(path, json=body, headers=headers)


def _check(response: httpx.Response, status: int, param: str | None, word: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"  # never an event stream, even for stream: true
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and word in error["message"], error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if status == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize("case, path, body, status, param, word", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_4xx(demo_server, case, path, body, status, param, word):
    _check(_send(demo_server, path, body), status, param, word)


def test_chat_errors_never_name_fields_the_request_did_not_use(demo_server):
    body = {**CHAT, "max_tokens": None, "max_completion_tokens": 3, "min_tokens": 5}
    message = demo_server.post("/v1/chat/completions", json=body).json()["error"]["message"]
    assert "max_tokens" not in message.replace("max_completion_tokens", "")


# Inputs that once crashed or were refused wrongly, and must work.
WORKS = [
    ("temperature 1e-50 is greedy", "/v1/completions", {**OK, "temperature": 1e-50}),
    ("temperature 1e-40, streamed chat", "/v1/chat/completions", {**CHAT, "temperature": 1e-40, "stream": True}),
    ("largest top_k", "/v1/completions", {**OK, "top_k": 2**63 - 1, "temperature": 0.8}),
    ("extreme valid penalties", "/v1/completions",
     {**OK, "repetition_penalty": 0.01, "presence_penalty": -2, "frequency_penalty": 2, "temperature": 1.5}),
    ("largest repetition penalty", "/v1/completions", {**OK, "repetition_penalty": 10.0, "temperature": 0.5}),
    ("stop ids and min_tokens", "/v1/completions", {**OK, "min_tokens": 2, "stop_token_ids": [0, 151679]}),
    ("smallest and largest seeds", "/v1/completions", {**OK, "seed": -(2**63), "n": 2, "temperature": 1}),
    ("neutral values of unsupported fields", "/v1/completions",
     {**OK, "best_of": 1, "logit_bias": {}, "guided_json": None, "use_beam_search": False}),
    ("harmless and unknown fields", "/v1/chat/completions",
     {**CHAT, "user": "u1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
      "some_future_field": {"x": 1}, "tool_choice": "none", "response_format": {"type": "text"}}),
    ("tools with tool_choice auto and parallel_tool_calls false", "/v1/chat/completions",
     {**CHAT, "tools": [tool_def("f")], "tool_choice": "auto", "parallel_tool_calls": False}),
    ("a history with a tool call and its result", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": "done"}], "tool_choice": "none",
      "tools": [tool_def("f")]}),
    ("responses with string input", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "store": False}),
    ("responses items sent back", "/v1/responses",
     {"max_output_tokens": 2, "input": [
         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
         {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
         {"type": "message", "id": "m1", "status": "completed", "role": "assistant",
          "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
         {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}",
          "status": "completed"},
         {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
    ("developer role and reasoning_content", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "ok", "reasoning_content": "thinking"},
                           {"role": "user", "content": [{"type": "text", "text": "again"}]}]}),
    ("surrogate pairs are fine", "/v1/completions", b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'),
    ("detokenize ids the tokenizer lacks but the model has", "/detokenize", {"tokens": [9707, 151679]}),
    ("json_schema with strict null and a description", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
         "name": "n", "description": "d", "schema": {"type": "object"}, "strict": None}}, "max_tokens": 2}),
]


@pytest.mark.parametrize("case, path, body", WORKS, ids=[c[0] for c in WORKS])
def test_inputs_that_must_work(demo_server, case, path, body):
    response = _send(demo_server, path, body)
    assert response.status_code == 200, response.text
    if path == "/detokenize":
        assert response.json()["prompt"] == "Hello"


def test_unknown_fields_are_named_in_a_warning(demo_server):
    assert demo_server.post("/v1/completions", json={**OK, "frobnicate_level": 3, "user": "x"}).status_code == 200
    warnings = [line for line in demo_server.log().splitlines() if "frobnicate_level" in line]
    assert warnings and "WARNING" in warnings[0] and "user" not in warnings[0].split("know:")[1]


def test_a_rejected_request_keeps_the_connection_alive(demo_server):
    """The surrogate once gave a 500 that dropped the keep-alive connection; now one connection carries on."""
    connection = http.client.HTTPConnection("127.0.0.1", demo_server.port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", body=SURROGATE_PROMPT,
                           headers={"content-type": "application/json"})
        first = connection.getresponse()
        assert first.status == 400 and not first.will_close
        first.read()
        sock = connection.sock
        connection.request("POST", "/v1/completions", body=json.dumps(OK),
                           headers={"content-type": "application/json"})
        second = connection.getresponse()
        assert second.status == 200 and connection.sock is sock
        second.read()
    finally:
        connection.close()


def test_a_foreign_host_header_is_refused(demo_server):
    """A loopback server answers loopback names only: a web page cannot reach it through DNS rebinding."""
    response = httpx.get(f"{demo_server.url}/v1/models", headers={"host": "attacker.example:8000"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host"
    assert httpx.get(f"{demo_server.url}/health", headers={"host": "localhost:1"}).status_code == 200


def test_models_by_name(demo_server):
    model = demo_server.client().models.retrieve(DEMO)
    assert model.id == DEMO and model.object == "model"
    unknown = httpx.get(f"{demo_server.url}/v1/models/gpt-9")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_bad_requests_do_not_harm_a_concurrent_stream(demo_server):
    """A healthy greedy stream runs while every bad request above is fired at the server; it finishes intact."""
    body = {"model": DEMO, "prompt": "A healthy request", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    expected = demo_server.post("/v1/completions", json=body).json()["choices"][0]["text"]
    first_chunk = threading.Event()
    texts, finish = [], []

    def stream() -> None:
        with httpx.stream("POST", f"{demo_server.url}/v1/completions", json={**body, "stream": True},
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    texts.append(choice["text"])
                    finish.append(choice["finish_reason"])
                    first_chunk.set()

    with ThreadPoolExecutor(8) as pool:
        healthy = pool.submit(stream)
        assert first_chunk.wait(60)
        bad = [pool.submit(_send, demo_server, path, b) for _, path, b, *_ in CASES]
        for future, (_, _, _, status, param, word) in zip(bad, CASES):
            _check(future.result(), status, param, word)
        healthy.result()
    assert "".join(texts) == expected and finish[-1] == "length"
    assert httpx.get(f"{demo_server.url}/health").status_code == 200
