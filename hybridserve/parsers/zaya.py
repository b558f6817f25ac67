"""ZAYA1's tool-call format (`--tool-call-parser zaya`).

One call per block, XML inside the block, one value per parameter:

    <zyphra_tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </zyphra_tool_call>

Sources: the tool parser of Zyphra's vLLM fork (github.com/Zyphra/vllm, vllm/tool_parsers/smoe_xml_tool_parser.py,
registered there as `zaya_xml`: tags `<zyphra_tool_call>` / `<function=` / `<parameter=`), and the ZAYA1 chat
templates that render past calls this way and tool results as `<zyphra_tool_response>` ... in a user turn (ZAYA1-8B's
tokenizer has these tags as single tokens, ids 101-104).

A value is text: the newline after `<parameter=NAME>` and the one before `</parameter>` are layout. It becomes a
JSON value by the parameter's schema, as Zyphra's parser does: a `string` parameter keeps the text as it is; a
string enum / const takes it stripped; anything else is read as JSON (numbers, booleans, null, objects, arrays)
and kept as the text when it is not JSON. The forcing grammar (xgrammar's `qwen_xml` JSON-schema style) writes
values this way.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hybridserve.parsers.tool_calls import MAX_WHITESPACE, ToolCall, ToolFormat, dumps_arguments, loads_json

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _types(schema: dict) -> list:
    kind = schema.get("type")
    return [kind] if isinstance(kind, str) else list(kind) if isinstance(kind, list) else []


def _value(raw: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema describes."""
    text = raw.removeprefix("\n").removesuffix("\n")
    schema = schema if isinstance(schema, dict) else {}
    types = _types(schema)
    if "string" in types and not ("null" in types and text.strip() == "null"):
        return text
    choices = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema \
        else None
    if choices and all(isinstance(choice, str) for choice in choices):
        return text.strip()
    try:
        return loads_json(text)
    except ValueError:
        return text


class ZayaFormat(ToolFormat):
    name = "zaya"
    start = "<zyphra_tool_call>"
    end = "</zyphra_tool_call>"

    def parse(self, body: str, tools: Mapping[str, dict]) -> ToolCall | None:
        function = _FUNCTION.fullmatch(body)
        if function is None or function[1] not in tools:
            return None
        properties = tools[function[1]].get("properties")
        properties = properties if isinstance(properties, dict) else {}
        arguments, position = {}, 0
        for parameter in _PARAMETER.finditer(function[2]):
            if parameter.start() != position:  # text between parameters
                return None
            arguments[parameter[1]] = _value(parameter[2], properties.get(parameter[1]))
            position = parameter.end()
        if function[2][position:].strip():
            return None
        return ToolCall(function[1], dumps_arguments(arguments))

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f"{self.start}\n<function={name}>\n",
                "content": {"type": "json_schema", "style": "qwen_xml", "json_schema": parameters,
                            "max_whitespace_cnt": MAX_WHITESPACE},
                "end": f"</function>\n{self.end}"}


ZAYA = ZayaFormat()
