"""`hybridserve serve` options reach the server state they configure (no server started): the --tool-call-parser
override, the --responses-store-* bounds of the Responses-API store, and --default-max-tokens over the generation
config's max_new_tokens."""
from __future__ import annotations

from types import SimpleNamespace

from hybridserve.cli import _server_options, build_parser
from hybridserve.parsers import LING, ZAYA, reasoning_format
from hybridserve.sampling import SamplingParams
from hybridserve.server.assistant import OutputParsing
from hybridserve.server.state import ServerState

PING = {"ping": {"type": "object", "properties": {}}}
LING_CALL = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def _state(*flags: str, model_type: str = "zaya", sampling_defaults: dict | None = None) -> ServerState:
    """The ServerState `hybridserve serve FLAGS` builds, over a stand-in engine that has loaded `model_type` (with
    the generation config's `sampling_defaults`)."""
    engine = SimpleNamespace(error=None, info=SimpleNamespace(model_type=model_type,
                                                              sampling_defaults=sampling_defaults or {}))
    return ServerState(engine, metrics=None, options=_server_options(build_parser().parse_args(["serve", *flags]),
                                                                          "unused"))


def test_tool_call_parser_flag_overrides_the_model_types_format():
    """Without the flag each model type parses its own format; with it a ZAYA1 server parses Ling's."""
    assert _state().tool_format() is ZAYA and _state(model_type="bailing_hybrid").tool_format() is LING
    overridden = _state("--tool-call-parser", "ling")
    assert overridden.tool_format() is LING
    parsed = OutputParsing(None, False, overridden.tool_format(), PING).parser().parse(LING_CALL)
    assert [call.name for call in parsed.tool_calls] == ["ping"] and parsed.content == ""
    default = OutputParsing(None, False, _state().tool_format(), PING).parser().parse(LING_CALL)
    assert default.tool_calls == [] and default.content == LING_CALL
    assert _state("--reasoning-parser", "ling").reasoning_format == reasoning_format("ling")
    assert _state().reasoning_format is None


def test_responses_store_flags_bound_the_store():
    """--responses-store-size and --responses-store-ttl reach the ResponseStore; the defaults are 1000 and 1 h."""
    store = _state("--responses-store-size", "3", "--responses-store-ttl", "2.5").responses
    assert (store.capacity, store.ttl_s) == (3, 2.5)
    default = _state().responses
    assert (default.capacity, default.ttl_s) == (1000, 3600.0)
    for i in range(5):
        store.put({"id": f"resp_{i}"}, [])
    assert len(store) == 3 and store.get("resp_1") is None and store.get("resp_4") is not None


def test_default_max_tokens_is_the_flags_else_the_generation_configs_else_4096():
    unset = SamplingParams(max_tokens=None)
    model = {"max_tokens": 7}  # the generation config's max_new_tokens
    assert _state("--default-max-tokens", "5", sampling_defaults=model).default_max_tokens(unset).max_tokens == 5
    assert _state(sampling_defaults=model).default_max_tokens(unset).max_tokens == 7
    assert _state().default_max_tokens(unset).max_tokens == 4096
    assert _state(sampling_defaults=model).default_max_tokens(SamplingParams(max_tokens=2)).max_tokens == 2
