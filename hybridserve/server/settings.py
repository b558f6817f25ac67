"""ServerOptions: the operator's settings of `hybridserve serve` (the fields made with `option` are its command-line
options, generated from here like the engine's from EngineConfig). Light to import: `--help` needs it."""
from __future__ import annotations

from dataclasses import dataclass

from hybridserve.options import option
from hybridserve.parsers import REASONING_FORMATS, TOOL_FORMATS, reasoning_format, tool_format

MiB = 1 << 20
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
UVICORN_LOG_LEVELS = (*LOG_LEVELS, "trace")  # uvicorn's own, trace below debug
FALLBACK_MAX_TOKENS = 4096  # requests' max_tokens when neither --default-max-tokens nor the model gives one


@dataclass(frozen=True)
class ServerOptions:
    # The names the model answers to: the first is the one responses and metrics carry, every one is accepted in
    # requests and listed by /v1/models (vLLM's --served-model-name list).
    served_model_names: tuple[str, ...]
    model_path: str = ""  # the model as the operator gave it (a Hub id or a path): /v1/models' root
    api_key: str | None = None  # required on /v1 and the tokenizer routes when set
    allowed_hosts: tuple[str, ...] | None = None  # Host header names answered (None: any)
    chat_template: str | None = None  # replaces the model's chat template
    shutdown_grace_s: float = 1.0  # in-flight requests may finish this long after SIGTERM / Ctrl+C
    max_request_body_bytes: int = option(4 * MiB, "larger request bodies get a 413 before they are read",
                                         default_help="4 MiB")
    max_n: int = option(256, "most sequences (prompts x n) one request may ask for")
    default_max_tokens: int | None = option(
        None, "tokens generated for requests that set no max_tokens (chat) or max_tokens: null; generation also "
              "stops at the end of the context",
        default_help=f"the generation config's max_new_tokens (--generation-config), else {FALLBACK_MAX_TOKENS}")
    trust_request_chat_template: bool = option(False, "accept chat_template in requests (it runs as code on the "
                                                      "server)")
    data_parallel_size: int = option(1, "independent engine replicas behind this server (each with --tp ranks of "
                                        "its own); a request goes to the replica that cached its prefix, else the "
                                        "least loaded one", flags=("--dp", "--data-parallel-size", "--dp-size"))
    tool_call_parser: str | None = option(None, "how tool calls are written in the model's output (the chat "
                                                "template must write that format)", choices=sorted(TOOL_FORMATS),
                                          default_help="the model's own: zaya for ZAYA1, ling for Ling-2.6")
    reasoning_parser: str | None = option(None, "split <think>...</think> reasoning into reasoning_content",
                                          choices=sorted(REASONING_FORMATS),
                                          default_help="off: the reasoning stays in the content")
    response_store_size: int = option(1000, "Responses-API responses kept in memory for previous_response_id and "
                                            "GET /v1/responses/{id} (the oldest dropped first; 0: none)",
                                      flags=("--responses-store-size",))
    response_store_ttl_s: float = option(3600.0, "how long a stored response is kept, in seconds",
                                         flags=("--responses-store-ttl",), metavar="SECONDS")
    log_requests: bool = option(False, "log a line when each API call arrives (its id, route, prompt size and "
                                       "sampling parameters) and when it ends (tokens, finish reasons, time)",
                                flags=("--enable-log-requests",), negation=("--disable-log-requests",))
    uvicorn_log_level: str = option("info", "uvicorn's own log level (vLLM's option; --log-level sets "
                                            "hybridserve's): warning and above also drop its access-log lines, "
                                            "which it logs at info", choices=UVICORN_LOG_LEVELS)
    disable_uvicorn_access_log: bool = option(False, "no access-log line per HTTP request (polls of GET /health, "
                                                     "/ping and /metrics are never logged)")
    log_stats_interval_s: float = option(10.0, "seconds between the stats lines logged while the server is busy "
                                               "(throughput, running / waiting, cache use, prefix-cache hits)",
                                         flags=("--log-stats-interval",), metavar="SECONDS")
    disable_log_stats: bool = option(False, "no periodic stats line")
    return_tokens_as_token_ids: bool = option(False, "logprobs name tokens as 'token_id:{id}' unless a request's "
                                                     "return_tokens_as_token_ids says otherwise (vLLM's)")
    prompt_tokens_details: bool = option(False, "usage carries prompt_tokens_details.cached_tokens (the prompt "
                                                "tokens the prefix cache served, 0 included) on every response",
                                         flags=("--enable-prompt-tokens-details", "--enable-cache-report"))

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("--served-model-name needs at least one name")
        if self.data_parallel_size < 1:
            raise ValueError(f"--dp {self.data_parallel_size}: at least one replica is needed")
        for flag, value in (("--max-request-body-bytes", self.max_request_body_bytes), ("--max-n", self.max_n),
                            ("--default-max-tokens", self.default_max_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level {self.uvicorn_log_level!r}: must be one of "
                             f"{', '.join(UVICORN_LOG_LEVELS)}")
        if self.tool_call_parser is not None:
            tool_format(self.tool_call_parser)
        if self.reasoning_parser is not None:
            reasoning_format(self.reasoning_parser)
        if self.response_store_size < 0 or self.response_store_ttl_s <= 0:
            raise ValueError("--responses-store-size must be >= 0 and --responses-store-ttl > 0")
        if self.log_stats_interval_s <= 0:
            raise ValueError("--log-stats-interval must be > 0 (--disable-log-stats turns the stats line off)")

    @property
    def served_model_name(self) -> str:
        """The name responses and metrics carry."""
        return self.served_model_names[0]
