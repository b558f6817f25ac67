"""What an assistant's generated text holds besides its answer: tool calls and reasoning.

tool_calls.py (the call, the format interface, the streaming extractor, the grammar of forced calls), one module
per model's tool-call format (zaya.py, ling.py), reasoning.py (`<think>` splitting), scan.py (tag look-ahead).
The registries map the `--tool-call-parser` and `--reasoning-parser` names to them.
"""
from __future__ import annotations

from hybridserve.parsers.ling import LING
from hybridserve.parsers.reasoning import REASONING_FORMATS, ReasoningFormat
from hybridserve.parsers.tool_calls import ToolFormat
from hybridserve.parsers.zaya import ZAYA

TOOL_FORMATS: dict[str, ToolFormat] = {fmt.name: fmt for fmt in (ZAYA, LING)}
_MODEL_TOOL_FORMATS = {"zaya": ZAYA, "bailing_hybrid": LING}  # config.json model_type -> its format


def tool_format(name: str) -> ToolFormat:
    """The format `--tool-call-parser name` selects."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_FORMATS))}")
    return TOOL_FORMATS[name]


def model_tool_format(model_type: str) -> ToolFormat:
    """The format a model type writes its tool calls in (the default parser)."""
    return _MODEL_TOOL_FORMATS[model_type]


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_FORMATS))}")
    return REASONING_FORMATS[name]
