"""vLLM's and SGLang's server flags that change what the server does, on a real `hybridserve serve` of the tiny
ZAYA1 checkpoint (vocabulary 128: token-id prompts): --generation-config DIR (sampling defaults for the fields a
request leaves unset), --max-total-tokens (the KV pool's size), --chunked-prefill-size -1 (no chunking),
--uvicorn-log-level (uvicorn's own lines), --enable-prompt-tokens-details (usage's cached tokens, 0 included) and
--return-tokens-as-token-ids (logprobs' tokens as "token_id:{id}" unless a request says otherwise)."""
from __future__ import annotations

import json
import re

import pytest

from tests.server.conftest import SMALL_CACHE, serve

NAME = "tiny"
PROMPT = list(range(1, 60))  # 59 tokens: a prompt the default budget would take whole either way


@pytest.fixture(scope="module")
def flags_server(zaya_dir, tmp_path_factory):
    generation = tmp_path_factory.mktemp("generation")
    (generation / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    server = serve([str(zaya_dir), "--served-model-name", NAME, "--dtype", "float32", "--page-size", "4",
                    "--generation-config", str(generation), "--max-total-tokens", "128", "--chunked-prefill-size",
                    "-1", "--uvicorn-log-level", "warning", "--enable-prompt-tokens-details",
                    "--return-tokens-as-token-ids", *SMALL_CACHE],
                   tmp_path_factory)
    yield server
    server.stop()


def _complete(server, **fields) -> dict:
    response = server.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "return_token_ids": True,
                                                    **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_generation_config_dir_gives_the_defaults_of_unset_fields(flags_server):
    """The folder's temperature 0 and max_new_tokens 3 apply where the request leaves them null; what a request
    sets wins."""
    defaulted = _complete(flags_server, max_tokens=None)
    greedy = _complete(flags_server, max_tokens=3, temperature=0)
    assert len(defaulted["token_ids"]) == 3 and defaulted["token_ids"] == greedy["token_ids"]
    assert len(_complete(flags_server, max_tokens=5)["token_ids"]) == 5
    assert re.search(r"sampling defaults from \S+generation_config\.json: temperature=0\.0, max_tokens=3",
                     flags_server.log())


def test_max_total_tokens_sizes_the_kv_pool(flags_server):
    log = flags_server.log()
    assert re.search(r"memory plan: .*KV [\d.]+ MiB = 128 tokens \(32 pages of 4, capped by --max-total-tokens\)",
                     log), log
    models = flags_server.client().models.list().data
    assert models[0].model_extra["max_model_len"] == 128  # lowered to what the KV pool holds
    too_long = flags_server.post("/v1/completions", json={"model": NAME, "prompt": [1] * 128, "max_tokens": 1})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]


def test_no_chunking_serves_prompts(flags_server):
    assert len(_complete(flags_server, max_tokens=2)["token_ids"]) == 2


def test_uvicorn_log_level_warning_drops_uvicorns_info_lines(flags_server):
    _complete(flags_server, max_tokens=1)
    log = flags_server.log()
    assert "serving 'tiny' at" in log  # hybridserve's own lines keep --log-level's info
    assert "Application startup complete" not in log and "uvicorn.access" not in log


def test_prompt_tokens_details_on_every_response(flags_server):
    """With the flag, usage always carries prompt_tokens_details (vLLM's): 0 cached tokens for a prompt first seen,
    the prefix cache's pages for its repeat, in plain and streamed usage alike."""
    prompt = list(range(60, 100))
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    first = flags_server.post("/v1/completions", json=body).json()["usage"]
    again = flags_server.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < len(prompt)
    streamed = flags_server.client().completions.create(model=NAME, prompt=prompt, max_tokens=1, stream=True,
                                                        stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in streamed if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == again["prompt_tokens_details"]["cached_tokens"]


def test_tokens_named_by_id_unless_the_request_says_otherwise(flags_server):
    default = _complete(flags_server, max_tokens=2, temperature=0, logprobs=1)
    assert default["logprobs"]["tokens"] == [f"token_id:{t}" for t in default["token_ids"]]
    assert all(list(top) == [f"token_id:{t}"] for top, t in zip(default["logprobs"]["top_logprobs"],
                                                                 default["token_ids"]))
    texts = _complete(flags_server, max_tokens=2, temperature=0, logprobs=1, return_tokens_as_token_ids=False)
    assert texts["token_ids"] == default["token_ids"]
    assert not any(token.startswith("token_id:") for token in texts["logprobs"]["tokens"])
