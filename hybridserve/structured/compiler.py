"""Compiled grammars: xgrammar's compiler for one tokenizer and vocabulary, with a bounded LRU of what it compiled.

Compiling turns a spec into per-state token masks over the whole vocabulary (tens of milliseconds for a JSON schema
over a 150k vocabulary), so each (kind, spec, strict) is compiled once and reused. One compiler serves every engine
of the process that shares a tokenizer and vocabulary (`shared_compiler`). The server's HTTP process compiles a
request's grammar off the event loop before queueing it (a 400 if it cannot) and ships it to the engine's process
serialized (`serialized` / `adopt`), so the engine never stalls its streams on a compile. Thread-safe. xgrammar
itself is imported on first use: an engine that never sees a grammar never loads it.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from hybridserve.structured.params import StructuredOutputError, StructuredOutputParams, json_object

if TYPE_CHECKING:
    import xgrammar

CACHE_BYTES = 1 << 30  # compiled grammars kept (by xgrammar's own size estimate), least recently used dropped first
_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ", sometimes "Check failed: (...) is false: ";
# the rest is the reason.
_NATIVE_PREFIX = re.compile(r"^(\[[^\]]*\]\s*\S+:\d+:\s*)?(Check failed: .*? is false:\s*)?")


def ebnf_literal(text: str) -> str:
    """`text` as a string literal of xgrammar's EBNF (quotes, backslashes and control characters escaped)."""
    def escape(char: str) -> str:
        if char in '"\\':
            return "\\" + char
        return char if char.isprintable() else f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}"

    return '"' + "".join(escape(c) for c in text) + '"'


def _reason(err: Exception) -> str:
    text = str(err).strip() or type(err).__name__
    return _NATIVE_PREFIX.sub("", text.splitlines()[0] if text else text)


class GrammarCompiler:
    """Compiles StructuredOutputParams for one tokenizer and vocabulary (`vocab_size` = the model's logits width;
    `stop_token_ids` = the tokens that end a request, the only ones allowed once the language is complete)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int],
                 cache_bytes: int = CACHE_BYTES):
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._tokenizer_info: xgrammar.TokenizerInfo | None = None  # the compiler's (to read serialized grammars)
        self._cache: OrderedDict[tuple, tuple[xgrammar.CompiledGrammar, int]] = OrderedDict()
        self._cached_bytes = 0

    def _xgrammar(self) -> xgrammar.GrammarCompiler:
        """xgrammar's compiler, built on first use from a tokenizer of our own (the engine's and the HTTP side's
        instances belong to their threads)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar

                from hybridserve.tokenizer import load_tokenizer
                info = xgrammar.TokenizerInfo.from_huggingface(
                    load_tokenizer(self.tokenizer_path), vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # the cache is ours
                self._tokenizer_info = info
            return self._compiler

    def compile(self, spec: StructuredOutputParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (cached). Raises StructuredOutputError naming the field when the spec
        cannot be compiled or matches no text the model can produce."""
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
        compiled = self._compile(spec, self._xgrammar())
        self._remember(key, compiled)
        return compiled

    def serialized(self, spec: StructuredOutputParams) -> str:
        """`spec`'s compiled grammar as xgrammar's JSON, for `adopt` in another process (the engine's): a few
        milliseconds to write and read where compiling again takes tens."""
        return self.compile(spec).serialize_json()

    def adopt(self, spec: StructuredOutputParams, serialized: str) -> None:
        """Cache `spec`'s grammar as another process's compiler (same tokenizer, vocabulary and stop set) wrote it
        with `serialized`, unless this cache holds it already."""
        import xgrammar

        key = spec.cache_key()
        with self._lock:
            if key in self._cache:
                return
        self._xgrammar()
        self._remember(key, xgrammar.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info))

    def _remember(self, key: tuple, compiled: xgrammar.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes
        with self._lock:
            if key not in self._cache:
                self._cache[key] = (compiled, size)
                self._cached_bytes += size
                while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    _, (_, dropped) = self._cache.popitem(last=False)
                    self._cached_bytes -= dropped

    def __len__(self) -> int:
        return len(self._cache)

    def _compile(self, spec: StructuredOutputParams, compiler: xgrammar.GrammarCompiler) -> xgrammar.CompiledGrammar:
        import xgrammar

        if spec.reasoning is not None:
            # The language alone first (compiled and cached): one that matches nothing must still be refused,
            # though with a lead the output could always start a reasoning block.
            self.compile(spec.without_reasoning())
            try:
                lead = xgrammar.Grammar.from_structural_tag(json.dumps(
                    {"type": "structural_tag", "format": json_object("reasoning", spec.reasoning)}))
            except Exception as err:
                raise StructuredOutputError("reasoning", spec.reasoning, f"cannot be compiled: {_reason(err)}") \
                    from None
            return compiler.compile_grammar(xgrammar.Grammar.concat(lead, _language(spec)))
        try:
            compiled = compiler.compile_grammar(_language(spec))
        except Exception as err:  # xgrammar raises RuntimeError / ValueError subclasses with the reason
            raise StructuredOutputError(spec.kind, getattr(spec, spec.kind), f"cannot be compiled: {_reason(err)}") \
                from None
        if not _allows_any_token(compiled, self.vocab_size):
            raise StructuredOutputError(spec.kind, getattr(spec, spec.kind), "matches no text the model can produce")
        return compiled


def _language(spec: StructuredOutputParams) -> xgrammar.Grammar:
    """The grammar of `spec`'s language (without its reasoning lead)."""
    import xgrammar

    kind = spec.kind
    value = getattr(spec, kind)
    if kind == "json":
        return xgrammar.Grammar.from_json_schema(json.dumps(json_object(kind, value)), any_whitespace=False,
                                                 strict_mode=spec.strict)
    if kind == "json_object":
        return xgrammar.Grammar.from_json_schema(_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgrammar.Grammar.from_regex(value)
    if kind == "choice":
        return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(ebnf_literal(c) for c in value))
    if kind == "grammar":  # EBNF rules are written `name ::= ...`, Lark's `name: ...`
        return xgrammar.Grammar.from_ebnf(value) if "::=" in value else xgrammar.Grammar.from_lark(value)
    return xgrammar.Grammar.from_structural_tag(json.dumps(json_object(kind, value)))


def _allows_any_token(compiled: xgrammar.CompiledGrammar, vocab_size: int) -> bool:
    """Whether a fresh matcher allows some first token (a language that matches nothing allows none, not even
    EOS)."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


_shared: dict[tuple, GrammarCompiler] = {}
_shared_lock = threading.Lock()


def shared_compiler(tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]) -> GrammarCompiler:
    """The process's compiler for this tokenizer, vocabulary and stop set (created on first request; building
    it is cheap until it compiles something)."""
    key = (tokenizer_path, vocab_size, tuple(sorted(stop_token_ids)))
    with _shared_lock:
        if key not in _shared:
            _shared[key] = GrammarCompiler(tokenizer_path, vocab_size, list(key[2]))
        return _shared[key]
