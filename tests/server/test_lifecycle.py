"""Starting and stopping like a product: a port in use fails at once, the start-up log says what runs where, the
Ling demo serves (and forces a tool call in Ling-2.6's format), SIGTERM / Ctrl+C end in-flight streams with an
error event and [DONE] and exit within 5 s."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from tests.server.conftest import SMALL_CACHE, Server, serve


def _hybridserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_port_in_use_fails_at_once_with_one_line(zaya_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = _hybridserve("serve", str(zaya_dir), "--device", "cpu", "--port", str(port))
        elapsed = time.monotonic() - start
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert elapsed < 60  # imports only: nothing was loaded


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_generate_on_cuda_without_a_gpu_prints_one_line():
    result = _hybridserve("generate", "--device", "cuda", "--prompt", "hi")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "error: --device cuda: no CUDA GPU is available on this machine; use --device cpu\n"


def test_the_ling_demo_serves_and_the_start_up_log_says_what_runs_where(tmp_path_factory):
    server = serve(["--demo", "ling", "--dtype", "float32", *SMALL_CACHE], tmp_path_factory)
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["hybridserve-demo-ling", "hybridserve-demo"]
        out = client.completions.create(model="hybridserve-demo-ling", prompt="Hello", max_tokens=5,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        chat = client.chat.completions.create(model="hybridserve-demo-ling", max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.role == "assistant"
        # Ling-2.6's tool-call format (the model type's parser; the demo's Qwen3 template writes the same format)
        tool = {"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}}}
        forced = client.chat.completions.create(model="hybridserve-demo-ling", max_tokens=200, temperature=0,
                                                messages=[{"role": "user", "content": "pick"}], tools=[tool],
                                                tool_choice={"type": "function", "function": {"name": "pick"}},
                                                parallel_tool_calls=False)
        (call,) = forced.choices[0].message.tool_calls
        assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "pick"
        assert json.loads(call.function.arguments)["colour"] in ("red", "blue")
        log = server.log()
    finally:
        server.stop()
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", line) for line in log.splitlines()
               if " INFO " in line or " WARNING " in line)
    assert f"serving 'hybridserve-demo-ling' / 'hybridserve-demo' at {server.url}/v1" in log
    assert re.search(r"loaded LingForCausalLM weights from \S*demo-bailing_hybrid\S* in \d+\.\d s", log), log
    assert re.search(r"model ready in \d+\.\d s: .* device cpu, dtype float32, max_model_len \d+", log), log
    plan = next(line for line in log.splitlines() if "memory plan" in line)
    assert re.search(r"state \d+\.\d\d MiB = \d+ slots of \d+\.\d\d MiB", plan) and "speculative" not in plan, plan


def _stream_until_killed(server: Server, sig: int) -> tuple[list[str], float, int]:
    """Start a long stream, send `sig` once tokens flow; (the stream's data lines, seconds from the signal to the
    process's exit, its exit code)."""
    lines: list[str] = []
    flowing = threading.Event()

    def read() -> None:
        body = {"prompt": "Tell me everything", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))
                    flowing.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert flowing.wait(60)
    start = time.monotonic()
    server.process.send_signal(sig)
    code = server.process.wait(timeout=30)
    elapsed = time.monotonic() - start
    reader.join(30)
    return lines, elapsed, code


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_streams_with_an_error_event_and_done_then_exits(tmp_path_factory, sig):
    server = serve(["--dtype", "float32", *SMALL_CACHE], tmp_path_factory)
    try:
        lines, elapsed, code = _stream_until_killed(server, sig)
    finally:
        server.stop()
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert all("choices" in json.loads(line) for line in lines[:-2])
    print(f"{signal.Signals(sig).name}: exit code {code} {elapsed:.2f} s after the signal")
    assert code == 0 and elapsed < 5, (code, elapsed)
    log = server.log()
    assert "Traceback" not in log and "Cancel" not in log, log[-3000:]
