"""Schemathesis over every POST route of the published OpenAPI schema, against a real server process.

Bounded: a fixed seed and example budget, one worker, a 48-token context with 8 default tokens (`guarded_server`),
and a wall-clock limit. Its checks: no 5xx, only documented status codes and content types, responses that match
the published schemas, and schema-invalid input refused. The server must answer a reference request identically
before and after.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import httpx

from tests.server.conftest import API_KEY

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance",
          "negative_data_rejection")
TIME_LIMIT_S = 480  # measured: ~100 s on 2 busy cores
REFERENCE = {"model": "hybridserve-demo", "prompt": "A reference request", "max_tokens": 6, "temperature": 0,
             "ignore_eos": True, "logprobs": 2}


def _statuses(report) -> Counter:
    """(operation, status) of every response schemathesis recorded."""
    counts: Counter = Counter()
    for line in report.read_text().splitlines():
        event = json.loads(line).get("ScenarioFinished")
        if event:
            for interaction in event["recorder"].get("interactions", {}).values():
                response = interaction.get("response") or {}
                counts[(event["recorder"]["label"], response.get("status_code"))] += 1
    return counts


# Fields schemathesis must fuzz (it generates from the published request schemas): structured output, vLLM's
# extras, tools and the Responses API (issue 13).
FUZZED_FIELDS = {"CompletionRequest": ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                       "guided_choice", "guided_grammar", "prompt_logprobs", "return_token_ids"),
                 "ChatCompletionRequest": ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                           "guided_choice", "guided_grammar", "prompt_logprobs", "return_token_ids",
                                           "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"),
                 "StreamOptions": ("include_usage", "continuous_usage_stats"),
                 "ResponsesRequest": ("input", "instructions", "previous_response_id", "text", "tools", "tool_choice",
                                      "parallel_tool_calls", "max_output_tokens", "store"),
                 "TextConfig": ("format",),
                 "TextFormat": ("type", "name", "schema", "strict")}


def _refs(schema: dict) -> set[str]:
    """The component names a property's schema refers to (directly or in an anyOf)."""
    return {option["$ref"].rsplit("/", 1)[1] for option in [schema, *schema.get("anyOf", [])] if "$ref" in option}


def test_the_fuzzed_schemas_publish_the_new_fields(guarded_server):
    schemas = httpx.get(f"{guarded_server.url}/openapi.json").json()["components"]["schemas"]
    for model, fields in FUZZED_FIELDS.items():
        assert set(fields) <= set(schemas[model]["properties"]), model
    assert set(schemas["ResponseFormat"]["properties"]["type"]["enum"]) == {"text", "json_object", "json_schema"}
    assert set(schemas["TextFormat"]["properties"]["type"]["enum"]) == {"text", "json_object", "json_schema"}
    chat, responses = schemas["ChatCompletionRequest"]["properties"], schemas["ResponsesRequest"]["properties"]
    assert _refs(responses["text"]) == {"TextConfig"} and _refs(schemas["TextConfig"]["properties"]["format"]) == {
        "TextFormat"}  # text.format is reachable, so schemathesis generates it
    assert all({"type": "string"} in responses[name]["anyOf"] for name in ("instructions", "previous_response_id"))
    assert _refs(chat["tool_choice"]) == {"NamedToolChoice"}
    assert {"none", "auto", "required"} == {value for option in chat["tool_choice"]["anyOf"]
                                            for value in option.get("enum", [])}
    assert chat["tools"]["anyOf"][0]["items"]["$ref"].endswith("/ChatTool")
    assert {"type": "boolean"} in chat["parallel_tool_calls"]["anyOf"]
    assert {"type": "object", "additionalProperties": True} in chat["chat_template_kwargs"]["anyOf"]


def test_schemathesis_finds_no_server_error_and_nothing_undocumented(guarded_server, tmp_path):
    auth = {"authorization": f"Bearer {API_KEY}"}
    before = guarded_server.post("/v1/completions", json=REFERENCE, headers=auth).json()
    report = tmp_path / "events.ndjson"
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{guarded_server.url}/openapi.json",
               "--include-method", "POST", "--checks", ",".join(CHECKS),
               "--header", f"Authorization: Bearer {API_KEY}", "--max-examples", "10", "--seed", "20261130",
               "--workers", "1", "--request-timeout", "60", "--report", "ndjson", "--report-ndjson-path", str(report)]
    # cwd: schemathesis keeps a cache in the working directory
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIME_LIMIT_S, cwd=tmp_path)
    statuses = _statuses(report)
    print(f"schemathesis: {sum(statuses.values())} requests, by (operation, status): {sorted(statuses.items())}")
    assert result.returncode == 0, result.stdout[-6000:]
    assert sum(statuses.values()) > 500
    assert not [key for key in statuses if key[1] is None or key[1] >= 500], statuses
    for operation in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /tokenize",
                      "POST /detokenize"):
        assert statuses[(operation, 200)] > 0 and statuses[(operation, 400)] > 0, operation  # both paths were hit
    assert guarded_server.process.poll() is None
    after = guarded_server.post("/v1/completions", json=REFERENCE, headers=auth).json()
    assert after["choices"] == before["choices"]  # text, logprobs, finish reason (cached_tokens may differ)
    assert after["usage"]["completion_tokens"] == before["usage"]["completion_tokens"] == 6
