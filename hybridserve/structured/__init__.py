"""Structured output: constrain generated text to a JSON schema, regex, choice or grammar with xgrammar.

params.py (the request-side spec), compiler.py (compiled grammars, cached per spec), matcher.py (one sequence's
grammar state), bitmask.py (the allowed-token masks: filled on the host, applied on the device)."""
from hybridserve.structured.params import StructuredOutputError, StructuredOutputParams

__all__ = ["StructuredOutputError", "StructuredOutputParams"]
