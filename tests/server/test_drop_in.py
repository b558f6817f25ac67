"""`hybridserve serve` as a vLLM / SGLang user starts it (issue 34): a Hub id (offline, from a cache laid out by
huggingface_hub's conventions), the flag names they type, a --config file, several served names; its logs, routes
and metrics; and the request fields their clients send (logit_bias, SGLang's regex / ebnf / json_schema,
reasoning_effort, continue_final_message, prompt_logprobs, the n and logprobs bounds), through the official client.

`hub_server` serves the tiny ZAYA1 checkpoint (vocabulary 128: token-id prompts) by id; the chat-shaped cases run
on the shared demo server, whose vocabulary is its tokenizer's."""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import SMALL_CACHE, serve
from tests.unit.hub_cache import cache_repo

NAMES = ("tiny", "tiny-alias")
CONFIG = "max-num-seqs: 8\nmax-logprobs: 3\nlog-stats-interval: 0.5\nmax-n: 300\n"


@pytest.fixture(scope="module")
def hub_server(zaya_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub-cache")
    cache_repo(cache, "org/tiny-zaya", zaya_dir)
    config = tmp_path_factory.mktemp("config") / "serve.yaml"
    config.write_text(CONFIG)
    server = serve(["org/tiny-zaya", "--config", str(config), "--download-dir", str(cache), "--served-model-name",
                    *NAMES, "--dtype", "float32", "--page-size", "4", "--context-length", "256",
                    "--trust-remote-code", "--enable-log-requests", *SMALL_CACHE], tmp_path_factory,
                   env={"HF_HUB_OFFLINE": "1"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(hub_server):
    return hub_server.client()


def _completion(client, extra_body=None, **fields):
    fields = {"model": NAMES[0], "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, **fields}
    return client.completions.create(extra_body={"return_token_ids": True, **(extra_body or {})}, **fields)


def test_a_hub_id_is_served_under_every_served_name(hub_server, client):
    models = client.models.list().data
    assert [m.id for m in models] == list(NAMES)
    assert {m.model_extra["root"] for m in models} == {"org/tiny-zaya"}
    assert models[0].model_extra["max_model_len"] == 256
    out = client.completions.create(model=NAMES[1], prompt=[1, 2, 3], max_tokens=2)
    assert out.model == NAMES[0]  # responses carry the first name, as vLLM's do
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/tiny-zaya")
    log = hub_server.log()
    assert "org/tiny-zaya: using the snapshot" in log and "models are native code" in log
    assert "max running requests 8" in log  # --max-num-seqs, from the config file


def test_routes_vllm_and_sglang_clients_probe(hub_server):
    assert httpx.get(f"{hub_server.url}/version").json()["version"]
    assert httpx.get(f"{hub_server.url}/ping").status_code == 200 == hub_server.post("/ping").status_code
    info = httpx.get(f"{hub_server.url}/get_model_info").json()
    assert (info["model_path"], info["model_type"], info["is_generation"], info["max_model_len"]) == \
        ("org/tiny-zaya", "zaya", True, 256)
    assert httpx.get(f"{hub_server.url}/health_generate", timeout=60).status_code == 200


def test_flush_cache_empties_the_prefix_cache(hub_server, client):
    client.completions.create(model=NAMES[0], prompt=list(range(1, 40)), max_tokens=1)
    assert hub_server.metrics()["hybridserve:kv_cache_pages_cached"] > 0
    response = hub_server.post("/flush_cache")
    assert response.status_code == 200 and response.text.startswith("Cache flushed")
    assert hub_server.metrics()["hybridserve:kv_cache_pages_cached"] == 0


def test_every_metric_sample_carries_the_model_name(hub_server, client):
    client.completions.create(model=NAMES[0], prompt=[5, 6], max_tokens=2)
    text = httpx.get(f"{hub_server.url}/metrics").text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("hybridserve:")]
    assert len(samples) > 20 and all(s.labels.get("model_name") == NAMES[0] for s in samples)


def test_logs_of_requests_stats_and_access(hub_server, client):
    out = client.completions.create(model=NAMES[0], prompt=[7, 8, 9], max_tokens=3, temperature=0)
    httpx.get(f"{hub_server.url}/health")
    httpx.get(f"{hub_server.url}/metrics")
    stats_line = re.compile(r"prompt throughput [\d.]+ tok/s, generation throughput [\d.]+ tok/s, running \d+ "
                            r"reqs, waiting \d+ reqs, KV cache [\d.]+%, state slots [\d.]+%, prefix-cache hit rate")
    deadline = time.monotonic() + 10.0  # the line comes at the first 0.5 s tick after the request's step
    while not stats_line.search(log := hub_server.log()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats_line.search(log)
    assert re.search(rf"request {out.id}: 1 prompt\(s\), 3 prompt tokens; temperature=0.0, max_tokens=3", log)
    assert re.search(rf"request {out.id} finished: 3 completion tokens, finish reasons \{{'length': 1\}}", log)
    access = [line for line in log.splitlines() if "uvicorn.access" in line]
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in access)
    assert not any(probe in line for line in access for probe in ("GET /health ", "GET /metrics "))


def test_logit_bias_moves_the_draws(client):
    plain = _completion(client).choices[0].model_extra["token_ids"]
    forced = _completion(client, logit_bias={"7": 100}).choices[0].model_extra["token_ids"]
    assert forced == [7, 7, 7, 7]
    banned = _completion(client, logit_bias={str(plain[0]): -100}).choices[0].model_extra["token_ids"]
    assert banned[0] != plain[0]
    streamed = client.completions.create(model=NAMES[0], prompt=[1, 2, 3], max_tokens=4, temperature=0.8, seed=3,
                                         logit_bias={"9": 100}, stream=True, extra_body={"return_token_ids": True})
    assert [t for chunk in streamed for t in chunk.choices[0].model_extra["token_ids"]] == [9, 9, 9, 9]


def test_allowed_token_ids_leave_only_those(client):
    out = _completion(client, temperature=1.0, seed=5, max_tokens=8, extra_body={"allowed_token_ids": [5, 9]})
    assert set(out.choices[0].model_extra["token_ids"]) <= {5, 9}


def test_invocations_answers_as_the_route_its_body_is_for(hub_server, client):
    body = {"model": NAMES[0], "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    invoked = hub_server.post("/invocations", json=body).json()
    assert invoked["object"] == "text_completion"
    assert invoked["choices"] == _completion(client, extra_body={"return_token_ids": False}).model_dump()["choices"]
    refused = hub_server.post("/invocations", json={**body, "max_tokens": "four"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_n_up_to_max_n_and_logprobs_up_to_max_logprobs(client):
    assert len(_completion(client, n=150, max_tokens=1).choices) == 150  # past the 128 the schema once allowed
    with pytest.raises(openai.BadRequestError, match="--max-n"):
        _completion(client, n=301)
    assert len(_completion(client, logprobs=3).choices[0].logprobs.top_logprobs[0]) == 3
    for fields in ({"logprobs": 4}, {"extra_body": {"prompt_logprobs": 4}}):
        with pytest.raises(openai.BadRequestError, match="must be at most 3"):
            _completion(client, **fields)


def test_prompt_logprobs_is_null_unless_asked(client):
    raw = _completion(client).model_dump()
    assert "prompt_logprobs" in raw["choices"][0] and raw["choices"][0]["prompt_logprobs"] is None
    asked = _completion(client, extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    assert asked[0] is None and len(asked) == 3


def test_prompt_logprobs_temperature_divides_the_logits(client):
    """vLLM's prompt_logprobs_temperature: the logprobs of logits / T, so the gap between two tokens' logprobs is
    the gap at T = 1 divided by T, and a lower T raises the likeliest token's probability."""
    def scored(temperature):
        out = _completion(client, prompt=[5, 9, 2, 7], extra_body={"prompt_logprobs": 3,
                                                                   "prompt_logprobs_temperature": temperature})
        return [{int(t): e["logprob"] for t, e in position.items()}
                for position in out.choices[0].model_extra["prompt_logprobs"][1:]]

    plain, sharp, flat = scored(1.0), scored(0.25), scored(5.0)
    for at_one, at_quarter, at_five in zip(plain, sharp, flat):
        best, *others = sorted(at_one, key=at_one.get, reverse=True)
        for token in others:
            gap = at_one[best] - at_one[token]
            assert at_quarter[best] - at_quarter[token] == pytest.approx(gap / 0.25, abs=1e-3)
            assert at_five[best] - at_five[token] == pytest.approx(gap / 5.0, abs=1e-3)
        assert at_quarter[best] > at_one[best] > at_five[best]
    assert plain == scored(None)  # not given: T = 1, the model's own
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs_temperature"):
        _completion(client, extra_body={"prompt_logprobs": 1, "prompt_logprobs_temperature": 0})


# --- chat-shaped fields, on the demo (a vocabulary its tokenizer fills) ---------------------------------------------

DEMO = "hybridserve-demo"
ASK = [{"role": "user", "content": "Introduce the capital of France."}]


@pytest.fixture(scope="module")
def demo(demo_server):
    return demo_server.client()


@pytest.mark.parametrize("field, value, check", [
    ("regex", r"[0-9]{3}-[a-z]{2}", lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    ("ebnf", 'root ::= "yes" | "no"', lambda text: text in ("yes", "no")),
    ("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["n"]}),
     lambda text: isinstance(json.loads(text)["n"], int)),
])
def test_sglangs_structured_output_fields(demo, field, value, check):
    chat = demo.chat.completions.create(model=DEMO, messages=ASK, max_tokens=40, temperature=0,
                                        extra_body={field: value})
    assert check(chat.choices[0].message.content), chat.choices[0].message.content
    completion = demo.completions.create(model=DEMO, prompt="Answer:", max_tokens=40, extra_body={field: value})
    assert check(completion.choices[0].text), completion.choices[0].text


def _prompt_text(demo, demo_server, messages, extra_body=None, **fields) -> str:
    out = demo.chat.completions.create(model=DEMO, messages=messages, max_tokens=1,
                                       extra_body={"return_token_ids": True, **(extra_body or {})}, **fields)
    ids = out.model_extra["prompt_token_ids"]
    return demo_server.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_reasoning_effort_sets_the_templates_thinking_switch(demo, demo_server):
    off = _prompt_text(demo, demo_server, ASK, reasoning_effort="none")
    on = _prompt_text(demo, demo_server, ASK, reasoning_effort="high")
    assert off.endswith("<think>\n\n</think>\n\n") and "</think>" not in on
    responses_off = demo.responses.create(model=DEMO, input="hi", max_output_tokens=1, reasoning={"effort": "none"})
    responses_on = demo.responses.create(model=DEMO, input="hi", max_output_tokens=1,
                                         reasoning={"effort": "medium", "summary": "auto"})
    assert responses_off.usage.input_tokens > responses_on.usage.input_tokens  # the empty block's tokens


def test_continue_final_message_continues_the_assistants_turn(demo, demo_server):
    prompt = _prompt_text(demo, demo_server, [*ASK, {"role": "assistant", "content": "{\n"}],
                          extra_body={"continue_final_message": True})
    assert prompt.endswith("<|im_start|>assistant\n{\n")
