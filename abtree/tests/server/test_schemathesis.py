"""Schemathesis over every POST route of the published OpenAPI schema, against a real server process.

Bounded: a fixed seed and example budget, one worker, a 48-token context with 8 default tokens (`guarded_server`),
and a wall-clock limit. Its checks: no 5xx, only documented status codes and content types, responses that match
the published schemas, and schema-invalid input refused. The server must answer a reference request identically
before and after.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

from tests.server.conftest import API_KEY

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance",
          "negative_data_rejection")
TIME_LIMIT_S = 480  # measured: ~100 s on 2 busy cores
REFERENCE = {"model": "hybridserve-demo", "prompt": "A reference request", "max_tokens": 6, "temperature": 0,
             "ignore_eos": True, "logprobs": 2}


def _statuses(report) -> Counter:
    """(operation, status) of every response schemathesis recorded."""
    counts: Counter = Counter()
    for line in report.read_text().splitlines():
        event = json.loads(line).get("ScenarioFinished")
        if event:
            for interaction in event["recorder"].get("interactions", {}).values():
                response = interaction.get("response") or {}
                counts[(event["recorder"]["label"], response.get("status_code"))] += 1
    return counts


def test_schemathesis_finds_no_server_error_and_nothing_undocumented(guarded_server, tmp_path):
    auth = {"authorization": f"Bearer {API_KEY}"}
    before = guarded_server.post("/v1/completions", json=REFERENCE, headers=auth).json()
    report = tmp_path / "events.ndjson"
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{guarded_server.url}/openapi.json",
               "--include-method", "POST", "--checks", ",".join(CHECKS),
               "--header", f"Authorization: Bearer {API_KEY}", "--max-examples", "10", "--seed", "20261130",
               "--workers", "1", "--request-timeout", "60", "--report", "ndjson", "--report-ndjson-path", str(report)]
    # cwd: schemathesis keeps a cache in the working directory
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIME_LIMIT_S, cwd=tmp_path)
    statuses = _statuses(report)
    print(f"schemathesis: {sum(statuses.values())} requests, by (operation, status): {sorted(statuses.items())}")
    assert result.returncode == 0, result.stdout[-6000:]
    assert sum(statuses.values()) > 500
    assert not [key for key in statuses if key[1] is None or key[1] >= 500], statuses
    for operation in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"):
        assert statuses[(operation, 200)] > 0 and statuses[(operation, 400)] > 0, operation  # both paths were hit
    assert guarded_server.process.poll() is None
    after = guarded_server.post("/v1/completions", json=REFERENCE, headers=auth).json()
    assert after["choices"] == before["choices"]  # text, logprobs, finish reason (cached_tokens may differ)
    assert after["usage"]["completion_tokens"] == before["usage"]["completion_tokens"] == 6
