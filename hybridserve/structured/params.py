"""StructuredOutputParams: what a request's output must match (a JSON schema, any JSON object, a regex, one of some
strings, an EBNF grammar or an xgrammar structural tag), checked for its form on construction.

The grammar itself is checked when it is compiled against the model's vocabulary (`structured.compiler`), which
`LLMEngine.add_request` does before anything is queued and the server does before it answers: a schema, regex or
grammar that cannot be compiled is an error naming the field, never a failure inside a step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

# The kinds, in the order the fields are declared; exactly one is given.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_CHOICES = 1024


class StructuredOutputError(ValueError):
    """An invalid structured-output field; `param` names it (e.g. "json"), `why` says what is allowed."""

    def __init__(self, param: str, value, why: str):
        super().__init__(f"invalid structured output {param}={_short(value)}: {why}")
        self.param, self.value, self.why = param, value, why

    def __reduce__(self):  # pickled from the engine's process to the server's with its fields
        return type(self), (self.param, self.value, self.why)


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class StructuredOutputParams:
    """Constrain generated text to a language (exactly one field besides `strict`). Tokens the language does not
    allow next are masked before sampling; when the language is complete only EOS is allowed, and the request
    finishes (finish reason "stop") once the grammar has accepted it.

    - `json`: a JSON Schema (a dict, or its JSON text). Output is compact JSON (", " and ": " separators, no
      other whitespace between values), so a model cannot spend its budget on whitespace. `strict` (default
      True): objects have only the properties the schema declares unless it allows more (`additionalProperties`);
      False follows JSON Schema's defaults, where undeclared properties are allowed.
    - `json_object`: True for any JSON object (compact, as above).
    - `regex`: the whole output matches this regular expression (xgrammar's dialect: no lookaround).
    - `choice`: the output is exactly one of these strings.
    - `grammar`: an EBNF grammar in xgrammar's dialect (GBNF-like: `root ::= "a" rule`; the start rule is `root`),
      or, as vLLM also takes, a Lark grammar (`start: "a" rule`; no `::=` anywhere in it).
      The tool-calling layer enforces `tool_choice="required"` or a named function by giving such a grammar.
    - `structural_tag`: an xgrammar structural tag (a dict, or its JSON text), e.g.
      `{"type": "structural_tag", "format": {"type": "triggered_tags", ...}}`: free text with tagged regions
      whose contents follow a schema (tool calls inside `<tool_call>...</tool_call>` and the like).

    `reasoning` (optional, beside any kind): an xgrammar structural-tag *format* (a dict, or its JSON text) that
    the output writes first, the language above applying only after it: a reasoning model's `<think>` ...
    `</think>` block. The server sets it for chat and Responses requests when a reasoning parser is on
    (`ReasoningFormat.lead`), so that the constrained answer lands in `content` after the reasoning instead of
    being forced from the first token, which a reasoning parser would then read as reasoning.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    strict: bool = True
    reasoning: dict | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(
                "structured_output", {k: getattr(self, k) for k in given},
                f"give exactly one of {', '.join(KINDS)} (got {len(given)}: {', '.join(given) or 'none'})")
        self._check(given[0])

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def _check(self, kind: str) -> None:
        value = getattr(self, kind)

        def fail(why: str) -> None:
            raise StructuredOutputError(kind, value, why)

        if kind in ("json", "structural_tag"):
            json_object(kind, value)
        elif kind == "json_object":
            if value is not True:
                fail("must be True (or left False when another field is given)")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                fail("must be a non-empty string")
        elif kind == "choice":
            if not isinstance(value, list) or not 0 < len(value) <= MAX_CHOICES or not all(
                    isinstance(c, str) and c for c in value):
                fail(f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
        if not isinstance(self.strict, bool):
            raise StructuredOutputError("strict", self.strict, "must be a bool")
        if self.reasoning is not None and "type" not in json_object("reasoning", self.reasoning):
            raise StructuredOutputError("reasoning", self.reasoning, "must be a structural-tag format: a JSON object "
                                        "with a 'type'")

    def cache_key(self) -> tuple[str, str, bool, str]:
        """What a compiled grammar depends on: (kind, the language as text, strict, the reasoning lead as text),
        JSON values canonicalised (sorted keys), so equal schemas given as dicts or text share one compiled grammar
        (in each process's cache, and as shipped from the server's process to the engine's)."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag"):
            text = _canonical(value)
        elif self.kind == "choice":
            text = json.dumps(value, ensure_ascii=False)
        else:
            text = "" if self.kind == "json_object" else value
        return self.kind, text, self.strict, "" if self.reasoning is None else _canonical(self.reasoning)

    def without_reasoning(self) -> StructuredOutputParams:
        """The same language with no reasoning lead."""
        return replace(self, reasoning=None)


def json_object(param: str, value: dict | str) -> dict:
    """`value` (a dict, or its JSON text) as a dict, or a StructuredOutputError on `param` saying why it is none."""
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as err:
            raise StructuredOutputError(param, value, f"is not valid JSON text ({err})") from None
    if not isinstance(parsed, dict):
        raise StructuredOutputError(param, value, "must be a JSON object (a dict, or its JSON text)")
    return parsed


def _canonical(value: dict | str) -> str:
    return json.dumps(json_object("", value), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
