"""Structured output and the vLLM extras through the official `openai` client against the demo server (random
weights, so every well-formed output below is the grammar's doing).

Termination: JSON is compact (no free whitespace) and every schema here bounds its leaves (integers and numbers
with a minimum and maximum, strings with maxLength, arrays with maxItems, no additional properties), so each
grammar has a longest output, well under max_tokens: a wandering model must close the document, and every output
must finish with "stop".
"""
from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

DEMO = "hybridserve-demo"
MESSAGES = [{"role": "user", "content": "Reply in JSON."}]
NUM_SCHEMAS = 20


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["integer", "number", "boolean", "enum", "string"])
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -rng.randint(0, 9), "maximum": rng.randint(1, 99)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, 42, None, True], rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    return {"type": "boolean"}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema: 1-4 properties (leaves, arrays, nested objects down to depth 2), all or some required."""
    properties = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["leaf", "leaf", "array", "object"] if depth < 2 else ["leaf"])
        if kind == "leaf":
            properties[f"p{i}"] = _leaf(rng)
        elif kind == "array":
            items = random_schema(rng, depth + 1) if depth == 0 and rng.random() < 0.3 else _leaf(rng)
            most = rng.randint(1, 3)
            properties[f"p{i}"] = {"type": "array", "items": items, "minItems": rng.randint(0, most), "maxItems": most}
        else:
            properties[f"p{i}"] = random_schema(rng, depth + 1)
    names = sorted(properties)
    required = names if rng.random() < 0.6 else sorted(rng.sample(names, rng.randint(1, len(names))))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _chat_json(client, schema: dict, seed: int, **extra):
    return client.chat.completions.create(
        model=DEMO, messages=MESSAGES, max_tokens=400, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}},
        **extra)


def test_twenty_random_schemas_give_json_that_validates(demo_server):
    rng = random.Random(13)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    client = demo_server.client()
    with ThreadPoolExecutor(NUM_SCHEMAS) as pool:  # concurrently: the grammar rows share steps
        responses = list(pool.map(lambda i: _chat_json(client, schemas[i], seed=i), range(NUM_SCHEMAS)))
    for schema, response in zip(schemas, responses):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


SMALL_SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]},
    "where": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 99}},
              "required": ["x"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["ok", "where"], "additionalProperties": False}


@pytest.mark.parametrize("field", ["guided_json", "response_format", "structured_outputs"])
def test_json_schema_on_completions_gives_json_that_validates(demo_server, field):
    """Every way of giving a JSON Schema works on /v1/completions too, not only on chat: two seeded samples each."""
    given = {"guided_json": SMALL_SCHEMA, "structured_outputs": {"json": SMALL_SCHEMA},
             "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": SMALL_SCHEMA}}}
    out = demo_server.client().completions.create(model=DEMO, prompt="JSON:", max_tokens=200, n=2, seed=11,
                                                  extra_body={field: given[field]})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SMALL_SCHEMA)


def test_strict_false_allows_undeclared_properties(demo_server):
    """json_schema with strict false follows JSON Schema's defaults (undeclared properties allowed); with strict
    true the same seeded samples hold only the declared property. An undeclared property is free text, so a sample
    may run to max_tokens; with this seed some finish with one, and every finished one validates."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}

    def samples(strict: bool) -> list:
        return demo_server.client().chat.completions.create(
            model=DEMO, messages=MESSAGES, max_tokens=30, n=4, seed=0, response_format={
                "type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": strict}}).choices

    for choice in samples(True):
        assert choice.finish_reason == "stop" and list(json.loads(choice.message.content)) == ["n"]
    finished = [json.loads(c.message.content) for c in samples(False) if c.finish_reason == "stop"]
    assert any(set(value) != {"n"} for value in finished), finished
    for value in finished:
        jsonschema.validate(value, schema)


def test_regex_choice_and_json_object(demo_server):
    client = demo_server.client()
    regex = r"(\d{3})-([a-z]{2,5})(!|\?)"
    for seed in range(3):
        completion = client.completions.create(model=DEMO, prompt="Code:", max_tokens=30, seed=seed,
                                               extra_body={"guided_regex": regex})
        assert re.fullmatch(regex, completion.choices[0].text) and completion.choices[0].finish_reason == "stop"
    choices = ["positive", "negative", "neutral (mixed)"]
    chat = client.chat.completions.create(model=DEMO, messages=MESSAGES, max_tokens=10, n=4, seed=5,
                                          extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in chat.choices)
    legacy = client.completions.create(model=DEMO, prompt="Pick:", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert legacy.choices[0].text in choices
    any_object = client.chat.completions.create(model=DEMO, messages=MESSAGES, max_tokens=60, seed=1,
                                                response_format={"type": "json_object"})
    content = any_object.choices[0].message.content
    assert content.startswith("{")
    if any_object.choices[0].finish_reason == "stop":  # an unconstrained object may outgrow the budget
        assert isinstance(json.loads(content), dict)


def test_streamed_structured_output_equals_the_unstreamed(demo_server):
    client = demo_server.client()
    schema = random_schema(random.Random(99))
    whole = _chat_json(client, schema, seed=7).choices[0]
    pieces = [chunk.choices[0] for chunk in _chat_json(client, schema, seed=7, stream=True) if chunk.choices]
    assert "".join(p.delta.content or "" for p in pieces) == whole.message.content
    assert pieces[-1].finish_reason == whole.finish_reason == "stop"
    body = {"model": DEMO, "prompt": "Id:", "max_tokens": 20, "seed": 3, "extra_body": {"guided_grammar": (
        'root ::= "ID-" [0-9]+ ("/" [a-z]+)?')}}
    whole = client.completions.create(**body).choices[0]
    streamed = [c.choices[0] for c in client.completions.create(**body, stream=True)]
    assert "".join(c.text for c in streamed) == whole.text and re.fullmatch(r"ID-\d+(/[a-z]+)?", whole.text)


def test_prompt_logprobs_and_token_ids_as_vllm_shapes_them(demo_server):
    client = demo_server.client()
    prompt = "The quick brown fox"
    ids = demo_server.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"model": DEMO, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    response = client.completions.create(**body, extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    choice = response.model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
    assert demo_server.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    echo = client.completions.create(**body, echo=True, logprobs=2).choices[0].logprobs
    for position, (token, entry) in enumerate(zip(ids[1:], entries[1:]), start=1):
        assert next(iter(entry)) == str(token)  # the prompt token first, then the top 2
        assert entry[str(token)]["logprob"] == pytest.approx(echo.token_logprobs[position], abs=1e-6)
        ranked = sorted(entry.values(), key=lambda e: -e["logprob"])
        assert [e["rank"] for e in ranked if e["rank"] is not None] == list(range(1, 3))
        assert entry[str(token)]["decoded_token"] == echo.tokens[position]
    chat = client.chat.completions.create(model=DEMO, messages=MESSAGES, max_tokens=4, temperature=0,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True}).model_dump()
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streamed_token_ids_and_continuous_usage(demo_server, route):
    client = demo_server.client()
    common = {"model": DEMO, "max_tokens": 12, "seed": 4, "extra_body": {"return_token_ids": True}}
    create = client.completions.create if route == "completions" else client.chat.completions.create
    source = {"prompt": "Stream me"} if route == "completions" else {"messages": MESSAGES}
    whole = create(**source, **common).model_dump()
    chunks = [c.model_dump() for c in create(**source, **common, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})]
    assert all(c["usage"] is not None for c in chunks)
    completion_tokens = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion_tokens == sorted(completion_tokens) and chunks[-1]["usage"] == whole["usage"]
    streamed_ids = [i for c in chunks for choice in c["choices"] for i in (choice.get("token_ids") or [])]
    assert streamed_ids == whole["choices"][0]["token_ids"]
    prompt_ids = whole["choices"][0]["prompt_token_ids"] if route == "completions" else whole["prompt_token_ids"]
    first = chunks[0]["choices"][0] if route == "completions" else chunks[0]
    assert first["prompt_token_ids"] == prompt_ids
