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
JSON value by the parameter's schema (`value_kind`), as Zyphra's parser does: a `string` parameter keeps the text
as it is; a string enum / const takes it stripped (unless the text itself is one of the choices); anything else is
read as JSON (numbers, booleans, null, objects, arrays) and kept as the text when it is not JSON.

The forcing grammar (`call_tag`) writes exactly that layout, parameter by parameter in the schema's order
(the required ones always, the others optionally), each value in the language its kind reads: raw text for a
string (xgrammar's qwen_xml form of the property's schema: maxLength, pattern, enum hold on the text itself),
the choices for an enum, JSON for the rest. No whitespace is free around a value, so what the grammar accepts is
what the parser reads back (xgrammar's qwen_xml on the whole object allowed up to 16 whitespace characters on each
side of a value, which a string value kept, breaking its maxLength). One ambiguity is the format's own: a string
value that itself contains a closing tag (`</parameter>`, `</function>`, `</zyphra_tool_call>`) would end the
value or the call early. The grammar keeps the tags out of every string where xgrammar can (`excluding`: not
beside a length, pattern or format, which it would then drop).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hybridserve.parsers.tool_calls import (
    MAX_WHITESPACE,
    ToolCall,
    ToolFormat,
    dumps_arguments,
    excluding,
    loads_json,
)

ZAYA_END = "</zyphra_tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _types(schema: dict) -> list:
    kind = schema.get("type")
    return [kind] if isinstance(kind, str) else list(kind) if isinstance(kind, list) else []


def _choices(schema: dict) -> list | None:
    return schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema \
        else None


def value_kind(schema: Any) -> str:
    """How a parameter's value is written: "text" (a string, raw), "choice" (one of string choices) or "json"."""
    schema = schema if isinstance(schema, dict) else {}
    if "string" in _types(schema):
        return "text"
    choices = _choices(schema)
    return "choice" if choices and all(isinstance(choice, str) for choice in choices) else "json"


def _value(raw: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema describes."""
    text = raw.removeprefix("\n").removesuffix("\n")
    kind = value_kind(schema)
    if kind == "text" and not ("null" in _types(schema) and text.strip() == "null"):
        return text
    if kind == "choice":
        return text if text in _choices(schema) else text.strip()
    try:
        return loads_json(text)
    except ValueError:
        return text


def _value_format(schema: Any, definitions: dict) -> dict:
    """The structural-tag format of one value of `schema` (its $defs / definitions carried along), its strings
    kept free of the call's closing tags where xgrammar can do that."""
    schema = {**schema, **definitions} if isinstance(schema, dict) else schema
    free_of_tags = excluding(["</parameter>", "</function>", ZAYA_END], schema)
    if value_kind(schema) == "json":
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE, **free_of_tags}
    return {"type": "json_schema", "style": "qwen_xml", "json_schema": schema, **free_of_tags}  # the text as it is


def _parameters_format(parameters: dict) -> dict:
    """Each declared parameter (and each required one that is not declared) as `<parameter=NAME>\nVALUE\n
    </parameter>\n`, in order; the ones not required optional."""
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    properties = {**properties, **{name: True for name in required if name not in properties}}
    definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    elements = []
    for name, schema in properties.items():
        tag = {"type": "tag", "begin": f"<parameter={name}>\n", "content": _value_format(schema, definitions),
               "end": "\n</parameter>\n"}
        elements.append(tag if name in required else {"type": "optional", "content": tag})
    return {"type": "sequence", "elements": elements} if elements else {"type": "const_string", "value": ""}


class ZayaFormat(ToolFormat):
    name = "zaya"
    start = "<zyphra_tool_call>"
    end = ZAYA_END

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
        return {"type": "tag", "begin": f"{self.start}\n<function={name}>\n", "content": _parameters_format(parameters),
                "end": f"</function>\n{self.end}"}


ZAYA = ZayaFormat()
