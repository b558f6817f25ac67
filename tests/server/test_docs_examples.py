"""The client examples of README.md and docs/serving.md run as written against a real server (the demo; only the
URL is this test server's). The README's offline example runs in tests/engine/test_offline_api.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/serving.md"])
def test_the_client_examples_run_as_written(demo_server, doc, capsys):
    blocks = [block for block in re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.DOTALL)
              if not block.startswith("from hybridserve import LLM")]
    assert blocks and blocks[0].startswith("from openai import OpenAI")
    namespace: dict = {}
    for block in blocks:  # in order, sharing one namespace (later examples use the first one's client)
        exec(compile(block.replace("http://127.0.0.1:8000", demo_server.url), doc, "exec"), namespace)
    printed = capsys.readouterr().out
    assert "CompletionUsage(" in printed if doc == "README.md" else "ChatCompletionMessageFunctionToolCall" in printed
