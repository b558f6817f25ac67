"""vLLM's request fields that change the prompt or the logprobs (issue 34), through the official client on the
demo server: truncate_prompt_tokens with truncation_side, return_tokens_as_token_ids, logprob_token_ids. Their bad
values are in test_bad_input's matrix."""
from __future__ import annotations

import httpx
import pytest

DEMO = "hybridserve-demo"
PROMPT = list(range(100, 108))  # eight token ids


@pytest.fixture(scope="module")
def client(demo_server):
    return demo_server.client()


CLIENT_ARGUMENTS = {"max_tokens", "logprobs", "top_logprobs", "echo", "stream"}  # the rest go in extra_body


def _split(fields: dict) -> tuple[dict, dict]:
    """A greedy request's client arguments (max_tokens 2 unless given), and its extra body (vLLM's fields, with
    return_token_ids on)."""
    fields = {"max_tokens": 2, "temperature": 0, **fields}
    own = {key: value for key, value in fields.items() if key in CLIENT_ARGUMENTS | {"temperature"}}
    return own, {"return_token_ids": True, **{key: value for key, value in fields.items() if key not in own}}


def _complete(client, prompt=PROMPT, **fields):
    own, extra = _split(fields)
    return client.completions.create(model=DEMO, prompt=prompt, extra_body=extra, **own)


def _chat(client, **fields):
    own, extra = _split(fields)
    return client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "Hello there"}],
                                          extra_body=extra, **own)


# --- truncate_prompt_tokens / truncation_side ----------------------------------------------------------------------

@pytest.mark.parametrize("side, kept", [(None, PROMPT[-4:]), ("left", PROMPT[-4:]), ("right", PROMPT[:4])])
def test_truncation_keeps_the_last_tokens_or_with_side_right_the_first(client, side, kept):
    out = _complete(client, truncate_prompt_tokens=4, **({"truncation_side": side} if side else {}))
    assert out.choices[0].model_extra["prompt_token_ids"] == kept
    assert out.usage.prompt_tokens == 4
    assert out.choices[0].model_extra["token_ids"] == _complete(client, prompt=kept).choices[0].model_extra[
        "token_ids"]


def test_a_prompt_within_the_limit_stays_whole_and_echo_shows_what_was_kept(client):
    assert _complete(client, truncate_prompt_tokens=8).choices[0].model_extra["prompt_token_ids"] == PROMPT
    text = "one two three four five six seven"
    cut = _complete(client, prompt=text, echo=True, truncate_prompt_tokens=3)
    kept = cut.choices[0].model_extra["prompt_token_ids"]
    assert len(kept) == 3 and cut.choices[0].text.startswith(" five six seven")
    both = _complete(client, prompt=[text, text[:3]], truncate_prompt_tokens=2)
    assert [len(c.model_extra["prompt_token_ids"]) for c in both.choices] == [2, 1]
    assert both.usage.prompt_tokens == 3


def test_minus_one_keeps_what_fits_the_context(client, demo_server):
    max_model_len = httpx.get(f"{demo_server.url}/v1/models").json()["data"][0]["max_model_len"]
    long_prompt = [(7 * i) % 1000 + 10 for i in range(max_model_len + 20)]
    out = _complete(client, prompt=long_prompt, max_tokens=1, truncate_prompt_tokens=-1)
    assert out.choices[0].model_extra["prompt_token_ids"] == long_prompt[-(max_model_len - 1):]
    assert out.usage.prompt_tokens == max_model_len - 1


def test_chat_truncates_the_rendered_prompt(client):
    whole = _chat(client).model_extra["prompt_token_ids"]
    for side, kept in (("left", whole[-5:]), ("right", whole[:5])):
        out = _chat(client, truncate_prompt_tokens=5, truncation_side=side)
        assert out.model_extra["prompt_token_ids"] == kept and out.usage.prompt_tokens == 5


# --- return_tokens_as_token_ids ------------------------------------------------------------------------------------

def test_completion_logprobs_name_tokens_by_id(client):
    plain = _complete(client, prompt="The capital of France", logprobs=2, echo=True)
    named = _complete(client, prompt="The capital of France", logprobs=2, echo=True, return_tokens_as_token_ids=True)
    choice, logprobs = named.choices[0], named.choices[0].logprobs
    ids = choice.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
    assert logprobs.tokens == [f"token_id:{i}" for i in ids]
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs[1:] for key in top)
    assert logprobs.top_logprobs[0] is None and len(logprobs.top_logprobs[-1]) in (2, 3)
    assert logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert logprobs.text_offset == plain.choices[0].logprobs.text_offset  # offsets into the text, as before
    assert choice.text == plain.choices[0].text


def test_chat_logprobs_name_tokens_by_id_and_keep_their_bytes(client):
    plain = _chat(client, logprobs=True, top_logprobs=2)
    named = _chat(client, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    content = named.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{i}" for i in named.choices[0].model_extra["token_ids"]]
    assert all(top.token.startswith("token_id:") for c in content for top in c.top_logprobs)
    assert [c.bytes for c in content] == [c.bytes for c in plain.choices[0].logprobs.content]
    assert [c.logprob for c in content] == [c.logprob for c in plain.choices[0].logprobs.content]


# --- logprob_token_ids ---------------------------------------------------------------------------------------------

def _ids(names) -> set[int]:
    return {int(name.removeprefix("token_id:")) for name in names}


def test_listed_ids_are_scored_at_every_position_in_place_of_the_top_ones(client):
    out = _complete(client, logprobs=5, max_tokens=3, logprob_token_ids=[5000, 100], allowed_token_ids=[42],
                    return_tokens_as_token_ids=True)
    logprobs = out.choices[0].logprobs
    assert logprobs.tokens == ["token_id:42"] * 3
    assert [_ids(top) for top in logprobs.top_logprobs] == [{42, 5000, 100}] * 3
    assert all(value < 0 for top in logprobs.top_logprobs for value in top.values())  # raw: not masked to -inf


def test_listed_ids_get_the_models_own_logprobs(client):
    """Listing the natural top 5 gives back their values: the raw model's, which allowed_token_ids leaves alone."""
    natural = _complete(client, logprobs=5, max_tokens=1, return_tokens_as_token_ids=True)
    top = natural.choices[0].logprobs.top_logprobs[0]
    listed = _complete(client, logprobs=0, max_tokens=1, logprob_token_ids=sorted(_ids(top)),
                       allowed_token_ids=[42], return_tokens_as_token_ids=True)
    scored = listed.choices[0].logprobs.top_logprobs[0]
    assert {name: scored[name] for name in top} == pytest.approx(top, abs=1e-5)  # fp32, other chunking


def test_listed_ids_when_streamed(client):
    stream = _complete(client, logprobs=1, max_tokens=2, stream=True, logprob_token_ids=[5000],
                       allowed_token_ids=[42], return_tokens_as_token_ids=True)
    tops = [top for chunk in stream for top in (chunk.choices[0].logprobs.top_logprobs if chunk.choices[0].logprobs
                                                else []) if top is not None]
    assert [_ids(top) for top in tops] == [{42, 5000}] * 2


def test_chat_shows_every_listed_id_whatever_top_logprobs_says(client):
    for top_logprobs in (1, None):
        out = _chat(client, logprobs=True, top_logprobs=top_logprobs, logprob_token_ids=[100, 1000, 5000],
                    allowed_token_ids=[5000], return_tokens_as_token_ids=True)
        for position in out.choices[0].logprobs.content:
            assert position.token == "token_id:5000"
            names = [top.token for top in position.top_logprobs]
            assert _ids(names) == {100, 1000, 5000} and len(names) == 3
    stream = _chat(client, logprobs=True, stream=True, logprob_token_ids=[5000], allowed_token_ids=[42],
                   return_tokens_as_token_ids=True)
    seen = [_ids(top.token for top in c.top_logprobs) for chunk in stream
            if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert seen == [{42, 5000}] * 2
