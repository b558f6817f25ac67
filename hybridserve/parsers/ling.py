"""Ling-2.6's tool-call format (`--tool-call-parser ling`): one JSON object per block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
    </tool_call>

Source: inclusionAI's Ling-2.6 serving recipe (SGLang's cookbook page for Ling-2.6 runs it with
`--tool-call-parser qwen25`, the Qwen2.5 / Hermes JSON-in-`<tool_call>` format); Qwen3's chat template (the demo
checkpoint's) renders calls and instructs the model exactly this way. `arguments` must be a JSON object; a block
that is not such an object, or names a function the request did not offer, is malformed (left in the content).
"""
from __future__ import annotations

import json
from collections.abc import Mapping

from hybridserve.parsers.tool_calls import (
    MAX_WHITESPACE,
    ToolCall,
    ToolFormat,
    dumps_arguments,
    excluding,
    loads_json,
)


class LingFormat(ToolFormat):
    name = "ling"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, body: str, tools: Mapping[str, dict]) -> ToolCall | None:
        try:
            call = loads_json(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in tools:
            return None
        arguments = call.get("arguments")
        if not isinstance(arguments, dict):
            return None
        return ToolCall(call["name"], dumps_arguments(arguments))

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f'{self.start}\n{{"name": {json.dumps(name)}, "arguments": ',
                "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": MAX_WHITESPACE,
                            **excluding([self.end], parameters)},
                "end": f"}}\n{self.end}"}


LING = LingFormat()
