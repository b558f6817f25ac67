"""The OpenAI-compatible surface, through the official `openai` client (and raw httpx for SSE framing)."""
from __future__ import annotations

import json
import math

import httpx
import pytest

DEMO = "hybridserve-demo"
PROMPT = "The quick brown fox jumps over the lazy dog because"
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def sse_events(server, path: str, body: dict) -> list[dict]:
    """The JSON events of one streamed response, checking the framing: `data: {json}` blocks, then [DONE]."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    blocks = raw.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""], raw[-200:]
    assert all(block.startswith("data: ") for block in blocks[:-2])
    return [json.loads(block.removeprefix("data: ")) for block in blocks[:-2]]


@pytest.fixture(scope="module")
def client(demo_server):
    return demo_server.client()


def test_models_lists_the_served_model(client, tiny_server):
    (model,) = client.models.list().data
    assert model.id == DEMO and model.object == "model" and model.owned_by == "hybridserve"
    assert model.model_extra["max_model_len"] == 4096
    assert [m.id for m in tiny_server.client().models.list().data] == ["tiny-zaya"]


def test_streamed_completion_concatenates_to_the_non_streamed_one(client, demo_server):
    full = client.completions.create(model=DEMO, prompt=PROMPT, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens == len(
        demo_server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    chunks = list(client.completions.create(model=DEMO, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_batch_of_strings_gives_one_choice_per_prompt(client):
    prompts = [PROMPT, "Once upon a time", "1, 2, 3,"]
    alone = [client.completions.create(model=DEMO, prompt=p, **GREEDY).choices[0].text for p in prompts]
    batch = client.completions.create(model=DEMO, prompt=prompts, **GREEDY)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2]
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone
    assert batch.usage.completion_tokens == 36


def test_token_id_prompts_single_and_batch(tiny_server):
    client = tiny_server.client()
    prompts = [[5, 17, 99, 3, 64, 12], [7, 7, 7], [100, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    alone = [client.completions.create(model="tiny-zaya", prompt=p, **GREEDY) for p in prompts]
    assert [a.usage.prompt_tokens for a in alone] == [len(p) for p in prompts]  # no BOS added to given ids
    batch = client.completions.create(model="tiny-zaya", prompt=prompts, **GREEDY)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(map(len, prompts))


def test_chat_with_string_and_text_parts_content(client, demo_server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    plain = client.chat.completions.create(model=DEMO, messages=messages, **GREEDY)
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    assert client.chat.completions.create(model=DEMO, messages=parts, **GREEDY).choices[0].message.content == \
        plain.choices[0].message.content
    templated = demo_server.post("/tokenize", json={"messages": messages}).json()
    assert plain.usage.prompt_tokens == templated["count"]
    events = sse_events(demo_server, "/v1/chat/completions", {
        "model": DEMO, "messages": messages, "temperature": 0, "max_completion_tokens": 12, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == \
        plain.choices[0].message.content
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_chat_template_kwargs_reach_the_template(demo_server):
    messages = [{"role": "user", "content": "hi"}]
    default = demo_server.post("/tokenize", json={"messages": messages}).json()["tokens"]
    no_think = demo_server.post("/tokenize", json={"messages": messages,
                                                   "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert no_think["tokens"] != default  # Qwen3's template adds an empty think block


def test_stop_strings_are_cut_and_never_streamed_partially(client, demo_server):
    free = client.completions.create(model=DEMO, prompt=PROMPT, temperature=0, max_tokens=24,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 4]
    cut = free.index(stop)
    body = {"model": DEMO, "prompt": PROMPT, "temperature": 0, "max_tokens": 24, "stop": [stop], "stream": True}
    events = sse_events(demo_server, "/v1/completions", body)
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == free[:cut]  # nothing of the stop string was sent, not even its first characters
    assert (events[-1]["choices"][0]["finish_reason"], events[-1]["choices"][0]["stop_reason"]) == ("stop", stop)
    kept = client.completions.create(model=DEMO, prompt=PROMPT, temperature=0, max_tokens=24, stop=stop,
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == free[:cut + len(stop)] and kept.finish_reason == "stop"


def test_n_samples_are_seeded_and_reproducible(client):
    def sample():
        return client.completions.create(model=DEMO, prompt=PROMPT, n=3, seed=1234, temperature=1.0,
                                         max_tokens=8, extra_body={"ignore_eos": True})

    first, second = sample(), sample()
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == second.usage.prompt_tokens
    batch = client.completions.create(model=DEMO, prompt=[PROMPT, "Hello"], n=2, seed=9, max_tokens=4,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]  # prompt index * n + sample index


def test_echo_logprobs_align_with_the_prompt_tokens(client, demo_server):
    """What lm-eval's loglikelihood sends: token ids, echo, max_tokens 1, logprobs 1."""
    def tokenize(text: str) -> list[int]:
        return demo_server.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    ids = tokenize(PROMPT)
    probe = client.completions.create(model=DEMO, prompt=ids, temperature=0, max_tokens=1, logprobs=5)
    probe_lp = probe.choices[0].logprobs
    assert len(probe_lp.tokens) == 1 and len(probe_lp.top_logprobs[0]) >= 5
    # a likely continuation that is one token (so its id is known), and its logprob after the prompt
    text, expected = next((t, x) for t, x in probe_lp.top_logprobs[0].items() if len(tokenize(t)) == 1)
    scored = client.completions.create(model=DEMO, prompt=ids + tokenize(text), temperature=0, max_tokens=1,
                                       logprobs=1, echo=True).choices[0]
    lp = scored.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 and math.isfinite(x) for x in lp.token_logprobs[1:])
    assert scored.text.startswith(PROMPT + text) and lp.text_offset[0] == 0
    for token, offset in zip(lp.tokens[:len(ids)], lp.text_offset):  # ASCII prompt: offsets index the text
        assert scored.text[offset:offset + len(token)] == token
    assert lp.tokens[len(ids)] == text
    assert lp.token_logprobs[len(ids)] == pytest.approx(expected, abs=1e-4)
    top = lp.top_logprobs[len(ids)]  # the greedy check lm-eval makes: was the probe's greedy token the argmax?
    assert max(top, key=top.get) == probe_lp.tokens[0]


def test_chat_logprobs_list_the_top_alternatives(client):
    out = client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].token == item.token  # greedy: the argmax
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert bytes(item.bytes).decode() == item.token


def test_repeated_prompt_hits_the_prefix_cache(client, demo_server):
    """The repeat is served from the prefix cache (the metrics count its hits), with the same text; usage has no
    prompt_tokens_details without --enable-prompt-tokens-details (vLLM's; test_drop_in_flags.py has the flag)."""
    prompt = " ".join(f"word{i}" for i in range(60))  # well over a few KV pages
    first = client.completions.create(model=DEMO, prompt=prompt, max_tokens=2, temperature=0)
    state_hits = 'hybridserve:prefix_cache_hits_total{layer_kind="state"}'
    hits_before = demo_server.metrics()[state_hits]
    second = client.completions.create(model=DEMO, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details is None and second.usage.prompt_tokens_details is None
    assert 0 < demo_server.metrics()[state_hits] - hits_before < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text


def test_tokenize_detokenize_round_trip_and_tokenizer_info(demo_server):
    text = "Hybrid models carry state; ünïcödé too."
    tokens = demo_server.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 4096
    assert demo_server.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    info = httpx.get(f"{demo_server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
