"""The benchmarked server seen by a plain urllib client: one request's time to its first streamed token, the
server's own TTFT histogram, and a lone-request probe that tells the server's share of TTFT from the client's."""
from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from hybridserve.server.process import ServerProcess


class Server(ServerProcess):
    """The benchmarked server, serving `model` (its --served-model-name), stopped on leaving the `with` block."""

    def __init__(self, args: list[str], log_path: Path, model: str):
        super().__init__(args, log_path)
        self.model = model

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def ttft_sum_count(self) -> tuple[float, float]:
        """The server's own time-to-first-token histogram (arrival to the first token reaching the event loop):
        (sum in seconds, count)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():
            for field in ("sum", "count"):
                if line.startswith(f"hybridserve:time_to_first_token_seconds_{field}{{"):  # {model_name="..."}
                    values[field] = float(line.split()[-1])
        return values["sum"], values["count"]

    def first_token_ms(self, prompt: list[int], max_tokens: int) -> float:
        """Milliseconds from sending a streaming completion to its first data line (read to the end)."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True})
        request = urllib.request.Request(f"{self.url}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        start, first = time.perf_counter(), None
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if first is None and line.startswith(b"data: "):
                    first = time.perf_counter()
        return (first - start) * 1e3

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        request = urllib.request.Request(f"{self.url}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())


def probe_ttft(server: Server, input_len: int, output_len: int, requests: int = 16) -> dict:
    """TTFT of lone streaming requests seen two ways, to tell the server's share from the client's: by a plain
    urllib client here, and by the server's own histogram (arrival to the first token reaching the event loop; its
    mean over these requests, from the /metrics sum and count before and after)."""
    before = server.ttft_sum_count()
    client = sorted(server.first_token_ms([2000 + (i * 7 + j) % 5000 for j in range(input_len)], output_len)
                    for i in range(requests))
    after = server.ttft_sum_count()
    return {"requests": requests, "client_ttft_ms_p50": client[len(client) // 2],
            "client_ttft_ms_mean": sum(client) / len(client),
            "server_ttft_ms_mean": (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3}
