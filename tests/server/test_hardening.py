"""The operator's hardening options on a real server (`guarded_server`): the API key, the body limit, --max-n, the
default max_tokens, chat templates (the operator's, a trusted request's, one that loops forever), and the OpenAI
streaming shape a peer test suite checks."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from hybridserve.cli import build_parser
from tests.server.conftest import API_KEY

DEMO = "hybridserve-demo"
AUTH = {"authorization": f"Bearer {API_KEY}"}
CHAT = {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def post(server, path: str, body: dict, **headers) -> httpx.Response:
    return server.post(path, json=body, headers={**AUTH, **headers})


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("GET", f"/v1/models/{DEMO}"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
    ("POST", "/flush_cache"), ("GET", "/get_model_info")])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {API_KEY}", API_KEY])
def test_api_key_guards_every_api_route(guarded_server, method, path, authorization):
    headers = {"authorization": authorization} if authorization else {}
    response = httpx.request(method, f"{guarded_server.url}{path}", headers=headers, json={}, timeout=30)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"


def test_api_key_lets_the_openai_client_in_and_leaves_probes_open(guarded_server):
    with pytest.raises(openai.AuthenticationError):
        guarded_server.client("wrong").models.list()
    client = guarded_server.client(API_KEY)
    assert [m.id for m in client.models.list().data] == [DEMO]
    assert client.completions.create(model=DEMO, prompt="hi", max_tokens=3).usage.completion_tokens == 3
    for probe in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(f"{guarded_server.url}{probe}").status_code == 200, probe


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"


def test_bodies_over_the_limit_get_a_413(guarded_server):
    """Refused from Content-Length before reading, or while reading a chunked body; the server carries on."""
    big = json.dumps({"model": DEMO, "prompt": "x" * 70_000, "max_tokens": 1}).encode()
    response = guarded_server.post("/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    chunked = guarded_server.post("/v1/completions", content=chunks(),
                                  headers={**AUTH, "content-type": "application/json"})
    assert chunked.status_code == 413 and "--max-request-body-bytes" in chunked.json()["error"]["message"]
    assert post(guarded_server, "/v1/completions", {"prompt": "x" * 1000, "max_tokens": 1}).status_code == 400  # ctx
    assert post(guarded_server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_max_n_bounds_prompts_times_n(guarded_server):
    assert post(guarded_server, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2,
                                                     "temperature": 1}).status_code == 200
    response = post(guarded_server, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    assert response.status_code == 400 and "at most 4 per request (--max-n)" in response.json()["error"]["message"]


def test_requests_without_max_tokens_get_the_default_and_stop_at_the_context(guarded_server):
    """--default-max-tokens 8 on a 48-token context: chat without max_tokens generates 8 tokens; one whose prompt
    leaves fewer than 8 stops at the end of the context (no error: the client asked for no particular length)."""
    body = {"model": DEMO, "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]}
    usage = post(guarded_server, "/v1/chat/completions", body).json()["usage"]
    assert usage["completion_tokens"] == 8
    long = {**body, "messages": [{"role": "user", "content": "word " * 41}]}
    prompt_len = len(_tokens(guarded_server, messages=long["messages"]))
    assert 40 < prompt_len < 48
    out = post(guarded_server, "/v1/chat/completions", long).json()
    assert out["usage"]["total_tokens"] == 48 and out["choices"][0]["finish_reason"] == "length"


def _tokens(server, **body) -> list[int]:
    response = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]} | body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_operator_template_replaces_the_models_and_trusted_requests_may_bring_one(guarded_server):
    def encode(text: str) -> list[int]:
        return post(guarded_server, "/tokenize", {"prompt": text}).json()["tokens"]

    assert _tokens(guarded_server) == encode("<user>hi<assistant>")  # --chat-template FILE
    assert _tokens(guarded_server, chat_template="[{{ messages[0].content }}]") == encode("[hi]")
    info = httpx.get(f"{guarded_server.url}/tokenizer_info", headers=AUTH).json()
    assert info["chat_template"].startswith("{% for m in messages %}")


def test_a_template_that_loops_forever_is_stopped_and_stalls_nobody(guarded_server):
    """Nested range() loops ran ~10^10 iterations on the event loop; now they run on the prompt worker under a
    5 s deadline, while /health keeps answering."""
    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    result = {}

    def render() -> None:
        start = time.monotonic()
        result["response"] = post(guarded_server, "/v1/chat/completions", {**CHAT, "chat_template": looping})
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=render)
    thread.start()
    gaps, last = [], time.monotonic()
    while thread.is_alive():
        assert httpx.get(f"{guarded_server.url}/health", timeout=10).status_code == 200
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        time.sleep(0.1)
    thread.join()
    response = result["response"]
    assert response.status_code == 400 and response.json()["error"]["code"] == "template_timeout"
    assert 5 <= result["seconds"] < 30 and len(gaps) > 10 and max(gaps) < 3, (result["seconds"], max(gaps))
    assert post(guarded_server, "/v1/chat/completions", CHAT).status_code == 200


@pytest.mark.parametrize("logprobs", [None, 5])
@pytest.mark.parametrize("n", [1, 2])
def test_streamed_chat_chunks_have_the_shape_clients_check(guarded_server, logprobs, n):
    """A peer suite's check, run to the end of the context (no max_tokens): every choice starts with a role chunk;
    every later chunk without a finish_reason carries string content (and k top logprobs when asked for); usage
    comes last."""
    client = guarded_server.client(API_KEY)
    extra = {"logprobs": True, "top_logprobs": logprobs} if logprobs else {}
    stream = client.chat.completions.create(
        model=DEMO, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
        stream=True, stream_options={"include_usage": True}, n=n, extra_body={"ignore_eos": True}, **extra)
    first: dict[int, bool] = {}
    finished, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        assert usage is None and chunk.id and chunk.created
        (choice,) = chunk.choices
        if choice.finish_reason is not None:
            finished.append(choice.finish_reason)
            continue
        if first.setdefault(choice.index, True):
            assert choice.delta.role == "assistant"
            first[choice.index] = False
            continue
        assert isinstance(choice.delta.content, str), chunk
        if logprobs:
            assert choice.logprobs.content and len(choice.logprobs.content[0].top_logprobs) == logprobs
    assert sorted(first) == list(range(n)) and finished == ["length"] * n
    assert usage.completion_tokens == 8 * n
