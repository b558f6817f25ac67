"""Real `hybridserve serve` processes on free localhost ports, shared by the server tests.

- `demo_server`: the built-in demo checkpoint (no MODEL_DIR; its vocabulary matches the real Qwen3 tokenizer, so
  text prompts and chat work), float32 so greedy outputs compare exactly.
- `tiny_server`: the tiny ZAYA1 checkpoint of `zaya_dir` (vocab 128: token-id prompts only), fast enough for the
  64-client, disconnect and chaos tests.
- `guarded_server`: the demo with the operator's hardening options on (an API key from the environment, a small
  context, body limit, --max-n and default max_tokens, an operator chat template, request templates trusted), a
  reasoning parser and Ling's tool-call parser in place of ZAYA1's own (--tool-call-parser): the API-key, template,
  reasoning, parser-override and schemathesis tests.
- `ling_server`: the Ling-2.6 demo checkpoint (its Qwen3 tokenizer and template, Ling's tool-call format) with the
  Ling reasoning parser on, as a Ling deployment runs: the Ling tool-call tests.

Each server runs with one intra-op thread: two servers and the test client share the CI machine's 2 cores, and
oversubscribed OpenMP threads spin, slowing tiny ops a hundredfold.
"""
from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.server.process import ServerProcess

STARTUP_TIMEOUT_S = 120
SMALL_CACHE = ["--kv-cache-memory-bytes", str(64 << 20)]  # quick to allocate and to free
API_KEY = "test-key-0123"
# Opens a reasoning block in the generation prompt when the first message is THINKING_ON (the Responses API takes
# no request template, so its reasoning tests need an operator template that can open one).
THINKING_ON = "detailed thinking on"
OPERATOR_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
                     "{% if messages[0].content == '" + THINKING_ON + "' %}<think>\n{% endif %}")


class Server(ServerProcess):
    """On the CPU with one intra-op thread; `env` adds to the environment."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        super().__init__([*args, "--device", "cpu"], log_path, {"OMP_NUM_THREADS": "1", **(env or {})})

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        try:
            super().wait_ready(timeout_s)
        except RuntimeError as err:
            pytest.fail(str(err))

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", timeout=120, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Every sample of GET /metrics by name (histograms as NAME_count, NAME_sum, ...; samples with labels
        besides model_name, which every one carries, as NAME{label="value"})."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples if "le" not in s.labels]
        labels = [{k: v for k, v in sorted(s.labels.items()) if k != "model_name"} for s in samples]
        return {s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in extra.items()) + "}" if extra else ""): s.value
                for s, extra in zip(samples, labels)}


def serve(args: list[str], tmp_path_factory, env: dict[str, str] | None = None) -> Server:
    """A started server (ready: /health is 200), stopped by the caller."""
    server = Server(args, tmp_path_factory.mktemp("server") / "server.log", env)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    server = serve(["--dtype", "float32", *SMALL_CACHE], tmp_path_factory)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_server(zaya_dir, tmp_path_factory):
    server = serve([str(zaya_dir), "--dtype", "float32", "--served-model-name", "tiny-zaya", "--page-size", "4",
                    *SMALL_CACHE], tmp_path_factory)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def guarded_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(OPERATOR_TEMPLATE)
    server = serve(["--dtype", "float32", *SMALL_CACHE, "--max-model-len", "48", "--max-n", "4",
                    "--max-request-body-bytes", "65536", "--default-max-tokens", "8", "--chat-template", str(template),
                    "--trust-request-chat-template", "--reasoning-parser", "qwen3", "--tool-call-parser", "ling"],
                   tmp_path_factory, env={"HYBRIDSERVE_API_KEY": API_KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")  # only the Ling tests use it: freed after their module
def ling_server(tmp_path_factory):
    server = serve(["--demo", "ling", "--dtype", "float32", *SMALL_CACHE, "--reasoning-parser", "ling"],
                   tmp_path_factory)
    yield server
    server.stop()
