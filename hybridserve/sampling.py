"""SamplingParams: what a request asks of the sampler and the stop logic, validated on construction.

The ranges are those OpenAI / vLLM accept (the HTTP API publishes the same numbers in its schema), plus bounds that
keep one request's cost per step small (stop strings and stop ids are checked after every token).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from hybridserve.outputs import RequestOutputKind
from hybridserve.structured.params import StructuredOutputParams

MAX_LOGPROBS = 20  # the engine's default bound on logprobs per token (EngineConfig.max_logprobs, vLLM's default)
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (dividing logits by them would overflow)
MAX_TEMPERATURE = 2.0
# vLLM's prompt_logprobs_temperature: the prompt's logits are divided by it before their logprobs are taken; it
# is not a sampling temperature (OpenAI's bound of 2 is not its), only kept where dividing stays finite.
PROMPT_LOGPROBS_TEMPERATURE_RANGE = (GREEDY_BELOW, 100.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties
REPETITION_PENALTY_RANGE = (0.01, 10.0)  # 1 = off; below 0.01 positive logits overflow when divided by it
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 32, 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # biased tokens per request (OpenAI allows 300)
MAX_LOGPROB_TOKEN_IDS = 128  # logprob_token_ids per request (vLLM's bound)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 all but forces it
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class SamplingParamError(ValueError):
    """An invalid sampling parameter; `param` names it and `why` says what is allowed."""

    def __init__(self, param: str, value, why: str):
        super().__init__(f"invalid sampling parameter {param}={value!r}: {why}")
        self.param, self.value, self.why = param, value, why

    def __reduce__(self):  # pickled from the engine's process to the server's with its fields
        return type(self), (self.param, self.value, self.why)


def out_of_vocabulary(token_ids: Iterable[int], vocab_size: int) -> str | None:
    """Why some of `token_ids` are not the model's, None when all are. Worded as vLLM words it ("Token id N is out
    of vocabulary", N the largest), since vLLM's clients and tests match that phrase, plus the valid range."""
    bad = sorted({t for t in token_ids if not 0 <= t < vocab_size})
    if not bad:
        return None
    more = f" (outside it: {bad[:5]}{' ...' if len(bad) > 5 else ''})" if len(bad) > 1 else ""
    return f"Token id {bad[-1]} is out of vocabulary: token ids must be in [0, {vocab_size}){more}"


def _is_int(value, low: int = INT64_MIN, high: int = INT64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _in_range(value, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and low <= value <= high


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Added to the logits of these tokens before penalties and sampling (OpenAI's logit_bias, token id -> bias).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Only these tokens may be sampled (vLLM's allowed_token_ids); empty: any.
    allowed_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top-k logprobs per generated token (0 = only the chosen token)
    # With logprobs: these tokens' logprobs too, at every generated token (vLLM's logprob_token_ids: a label set
    # scored whatever its rank).
    logprob_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: int | None = None  # the same for every prompt token
    prompt_logprobs_temperature: float = 1.0  # prompt logprobs of the logits divided by it (vLLM's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each engine step hands back
    structured_output: StructuredOutputParams | None = None  # the language the output must match (a grammar)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.allowed_token_ids = sorted(set(self.allowed_token_ids or []))
        self.logprob_token_ids = list(dict.fromkeys(self.logprob_token_ids or []))  # each once, in the given order
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise SamplingParamError(name, getattr(self, name), why)

        if not _is_int(self.n, 1):
            fail("n", "must be an integer >= 1")
        if not _in_range(self.temperature, 0.0, MAX_TEMPERATURE):
            fail("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (below {GREEDY_BELOW:g} means greedy)")
        if not _in_range(self.top_p, 0.0, 1.0) or self.top_p == 0.0:
            fail("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k, -1):
            fail("top_k", "must be an integer >= 1, or -1 / 0 to disable")
        if not _in_range(self.min_p, 0.0, 1.0):
            fail("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and not _is_int(self.max_tokens, 1):
            fail("max_tokens", "must be an integer >= 1 (or None for the rest of the context)")
        if not _is_int(self.min_tokens, 0):
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _in_range(getattr(self, name), *PENALTY_RANGE):
                fail(name, "must be in [{:g}, {:g}]".format(*PENALTY_RANGE))
        if not _in_range(self.repetition_penalty, *REPETITION_PENALTY_RANGE):
            fail("repetition_penalty", "must be in [{:g}, {:g}] (1 = no penalty)".format(*REPETITION_PENALTY_RANGE))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value, 0):
                fail(name, "must be an integer >= 0")
        if not _in_range(self.prompt_logprobs_temperature, *PROMPT_LOGPROBS_TEMPERATURE_RANGE):
            fail("prompt_logprobs_temperature", "must be in [{:g}, {:g}]".format(*PROMPT_LOGPROBS_TEMPERATURE_RANGE))
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", "must be a 64-bit signed integer")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutputParams):
                fail("structured_output", "must be a StructuredOutputParams (or None)")
            if self.min_tokens:
                fail("min_tokens", "cannot be combined with structured output: the grammar decides where the "
                                   "output may end")
        if len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            fail("stop", f"must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} "
                         "characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(_is_int(t, 0) for t in self.stop_token_ids):
            fail("stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} non-negative token ids")
        if not all(_is_int(t, 0) for t in self.allowed_token_ids):
            fail("allowed_token_ids", "must be token ids (integers >= 0)")
        if len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS or not all(_is_int(t, 0)
                                                                         for t in self.logprob_token_ids):
            fail("logprob_token_ids", f"must be at most {MAX_LOGPROB_TOKEN_IDS} token ids (integers >= 0)")
        if self.logprob_token_ids and self.logprobs is None:
            fail("logprob_token_ids", "needs logprobs (their logprobs come with the chosen token's)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or not all(
                _is_int(t, 0) and _in_range(b, *LOGIT_BIAS_RANGE) for t, b in self.logit_bias.items()):
            fail("logit_bias", "must map at most {} token ids (>= 0) to biases in [{:g}, {:g}]".format(
                MAX_LOGIT_BIAS, *LOGIT_BIAS_RANGE))

    def check_vocabulary(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """The model-dependent checks: stop ids are tokens the model has, and min_tokens leaves one token it may
        sample (it bans the stop ids and EOS until then)."""
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids", "logprob_token_ids"):
            why = out_of_vocabulary(getattr(self, name), vocab_size)
            if why is not None:
                raise SamplingParamError(name, getattr(self, name), why)
        banned = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        if self.min_tokens and len(banned) >= vocab_size:
            raise SamplingParamError("min_tokens", self.min_tokens,
                                     "stop_token_ids and EOS cover the whole vocabulary; nothing could be sampled")

    def check_logprobs(self, max_logprobs: int) -> None:
        """The engine's bound on logprobs per token (EngineConfig.max_logprobs, `--max-logprobs`)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise SamplingParamError(name, value, f"must be at most {max_logprobs} (the engine's max_logprobs, "
                                                      "--max-logprobs)")

    def describe(self) -> str:
        """The parameters that differ from their defaults, for a log line."""
        default = SamplingParams()
        changed = {f.name: getattr(self, f.name) for f in fields(self)
                   if f.name != "output_kind" and getattr(self, f.name) != getattr(default, f.name)}
        if self.structured_output is not None:
            changed["structured_output"] = self.structured_output.kind
        return ", ".join(f"{name}={value!r}" for name, value in changed.items()) or "defaults"
