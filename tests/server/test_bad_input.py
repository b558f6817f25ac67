"""Bad input gets a 4xx with an OpenAI-style body that says what to change, and harms nobody else's request."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

DEMO = "hybridserve-demo"
OK = {"model": DEMO, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (case, path, body (raw bytes are sent as they are), status, param, a word the message must contain)
CASES = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', 400, None, "JSON"),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None, "object"),
    ("missing prompt", "/v1/completions", {"model": DEMO}, 400, "prompt", "prompt"),
    ("prompt of a wrong type", "/v1/completions", {**OK, "prompt": {"text": "x"}}, 400, "prompt", "string"),
    ("max_tokens of a wrong type", "/v1/completions", {**OK, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("negative max_tokens", "/v1/completions", {**OK, "max_tokens": -5}, 400, "max_tokens", "max_tokens"),
    ("zero max_tokens", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("absurd max_tokens", "/v1/completions", {**OK, "max_tokens": 10**12}, 400, "max_tokens", "context length"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "empty"),
    ("empty prompt list", "/v1/completions", {**OK, "prompt": []}, 400, "prompt", "empty"),
    ("empty token list in a batch", "/v1/completions", {**OK, "prompt": [[1, 2], []]}, 400, "prompt", "empty"),
    ("prompt longer than the context", "/v1/completions", {**OK, "prompt": [11] * 5000}, 400, "prompt",
     "context length"),
    ("token id out of the vocabulary", "/v1/completions", {**OK, "prompt": [1, 2, 10**7]}, 400, "prompt",
     "vocabulary"),
    ("negative token id", "/v1/completions", {**OK, "prompt": [-1]}, 400, "prompt", "vocabulary"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-9"}, 404, "model", "does not exist"),
    ("stop of a wrong type", "/v1/completions", {**OK, "stop": 5}, 400, "stop", "string"),
    ("stop list with a number", "/v1/completions", {**OK, "stop": ["a", 1]}, 400, "stop", "string"),
    ("empty stop string", "/v1/completions", {**OK, "stop": [""]}, 400, "stop", "non-empty"),
    ("negative temperature", "/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("temperature as text", "/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", "number"),
    ("top_p of 0", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("top_p above 1", "/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("n = 0", "/v1/completions", {**OK, "n": 0}, 400, "n", ">= 1"),
    ("absurd n", "/v1/completions", {**OK, "n": 10**9}, 400, "n", "at most"),
    ("logprobs above 20", "/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs", "20"),
    ("echo of a wrong type", "/v1/completions", {**OK, "echo": "yes"}, 400, "echo", "boolean"),
    ("logit_bias", "/v1/completions", {**OK, "logit_bias": {"5": 10.0}}, 400, "logit_bias", "not supported"),
    ("no messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "at least 1"),
    ("message content of a wrong type", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages", "string"),
    ("image content part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content", "text"),
    ("top_logprobs above 20", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, 400,
     "top_logprobs", "20"),
    ("chat max_completion_tokens too large", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**6},
     400, "max_completion_tokens", "context length"),
    ("detokenize ids out of the vocabulary", "/detokenize", {"tokens": [10**9]}, 400, "tokens", "vocabulary"),
]


def _send(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return server.post(path, content=body, headers={"content-type": "application/json"})
    return server.post(path, json=body)


def _check(response: httpx.Response, status: int, param: str | None, word: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and word in error["message"], error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if status == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize("case, path, body, status, param, word", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_4xx(demo_server, case, path, body, status, param, word):
    _check(_send(demo_server, path, body), status, param, word)


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
