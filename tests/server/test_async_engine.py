"""The server's handle on the engine's process: request groups accepted whole or not at all, outputs routed to their
mailboxes, failures (a step, one request, the process itself) reaching the right callers, grammars shipped instead
of compiled twice. Test doubles run in the engine's process, so what they observe comes back through the pipe
(stats) or the file system."""
from __future__ import annotations

import asyncio
import gc
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridserve.config import EngineConfig
from hybridserve.demo import bundled_tokenizer_dir
from hybridserve.engine.engine import LLMEngine
from hybridserve.generation_config import GenerationConfig
from hybridserve.outputs import CompletionOutput, RequestOutput
from hybridserve.sampling import SamplingParams
from hybridserve.server.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineRequest,
    OutputMailbox,
)
from hybridserve.structured import StructuredOutputParams
from hybridserve.structured.compiler import shared_compiler

class StepFailsEngine:
    """Validates prompts like the engine, produces one output per request, then fails on the next step. Its
    `config.model` is a directory where its shutdown leaves the requests it still held."""

    model_dir, model_type, max_model_len, vocab_size, eos_token_ids = "double", "zaya", 64, 100, frozenset({0})
    runner = SimpleNamespace(model=object(), device="cpu", dtype="float32")
    generation_config = GenerationConfig()  # no generation_config.json: no sampling defaults

    def __init__(self, config: EngineConfig):
        self.directory = Path(config.model)
        self.pending: list[str] = []
        self.steps = 0

    def stats(self) -> dict[str, int]:
        return {"running": len(self.pending)}

    def shutdown(self) -> None:
        (self.directory / "shut_down").write_text(",".join(self.pending))

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        self.pending.append(request_id)

    def abort_request(self, request_id: str) -> None:
        self.pending.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps > 1:
            raise RuntimeError("boom")
        return [RequestOutput(rid, None, [0] * 1000, [CompletionOutput(0, "x", [5])]) for rid in self.pending]


async def until_ready(engine: AsyncEngine, timeout: float = 60) -> None:
    """Until the engine's process reports ready; its start-up error (or the timeout) fails the test instead of a
    wait without end."""
    async def wait() -> None:
        while not engine.ready:
            assert engine.error is None, engine.error
            await asyncio.sleep(0.05)
    await asyncio.wait_for(wait(), timeout)


def double(directory: Path, factory: type[StepFailsEngine]) -> AsyncEngine:
    """An AsyncEngine whose process runs the test double `factory` (its config's model is `directory`)."""
    return AsyncEngine(EngineConfig(model=str(directory), tokenizer=str(bundled_tokenizer_dir())),
                       engine_factory=factory)


def test_groups_are_atomic_outputs_arrive_and_a_failure_reaches_everyone(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = double(tmp_path, StepFailsEngine)
        fatal = asyncio.Event()
        engine.start(asyncio.get_running_loop(), fatal.set)
        params = SamplingParams()
        with pytest.raises(ValueError, match="empty"):  # queued before the model loaded; the group is refused whole
            await engine.add([EngineRequest("a", [1], params), EngineRequest("b", [], params)], OutputMailbox())
        mailbox = OutputMailbox()
        await engine.add([EngineRequest("c", [7, 8], params)], mailbox)
        assert engine.stats() == {"running": 1}  # "a" of the refused group was taken back
        (output,) = await mailbox.get()
        assert output.request_id == "c" and engine.info.max_model_len == 64
        assert output.prompt_token_ids == [7, 8]  # left out of the pipe, put back from the request
        with pytest.raises(EngineDead, match="boom"):
            await mailbox.get()
        await asyncio.wait_for(fatal.wait(), 30)
        with pytest.raises(EngineDead):
            await engine.add([EngineRequest("d", [1], params)], OutputMailbox())
        assert not engine.ready
        engine.stop()
        assert (tmp_path / "shut_down").read_text() == "c"  # the process's end stopped the engine (TP workers)

    asyncio.run(scenario())


def engine_failing_on_seed_666(config: EngineConfig) -> LLMEngine:
    """The real engine, in the engine's process, with a failure injected into one request's sampling."""
    from hybridserve.layers.sampler import Sampler

    draw_rows = Sampler._draw_rows

    def failing(self, logits, rows, mask):
        if any(row.seed == 666 for row in rows):
            raise RuntimeError("injected sampling failure")
        return draw_rows(self, logits, rows, mask)

    Sampler._draw_rows = failing
    return LLMEngine(config)


def test_a_request_that_fails_in_the_engine_ends_alone(zaya_dir):
    """The real engine with a failure injected into one request's sampling: that request's call gets its error,
    the other call finishes, and the engine keeps serving."""

    async def finish(mailbox: OutputMailbox) -> RequestOutput:
        while True:
            for output in await mailbox.get():
                if output.finished:
                    return output

    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model=str(zaya_dir), device="cpu", dtype="float32", use_tqdm=False,
                                          kv_cache_memory_bytes=64 << 20), engine_factory=engine_failing_on_seed_666)
        engine.start(asyncio.get_running_loop(), lambda: None)
        good, bad = OutputMailbox(), OutputMailbox()
        params = {"temperature": 0.7, "max_tokens": 5, "ignore_eos": True}
        await engine.add([EngineRequest("bad", [1, 2, 3], SamplingParams(seed=666, **params))], bad)
        await engine.add([EngineRequest("good", [4, 5, 6], SamplingParams(seed=1, **params))], good)
        failed, done = await asyncio.wait_for(asyncio.gather(finish(bad), finish(good)), 120)
        assert "injected sampling failure" in failed.error and failed.outputs[0].finish_reason == "abort"
        assert done.error is None and len(done.outputs[0].token_ids) == 5
        assert engine.ready and engine.error is None
        engine.stop()

    asyncio.run(scenario())


class HangingEngine(StepFailsEngine):
    """Never finishes a step (a wedged device, say): only ending its process stops it."""

    def step(self) -> list[RequestOutput]:
        (self.directory / "pid").write_text(str(os.getpid()))
        while True:
            signal.pause()


def test_an_engine_process_that_dies_fails_the_server_cleanly(tmp_path: Path) -> None:
    """Killed mid-step (out of memory, a segfault in a kernel): the open call and any later one get EngineDead
    naming the exit, and the server is told to stop instead of waiting forever."""
    async def scenario() -> None:
        engine = double(tmp_path, HangingEngine)
        fatal = asyncio.Event()
        engine.start(asyncio.get_running_loop(), fatal.set)
        mailbox = OutputMailbox()
        await engine.add([EngineRequest("a", [1], SamplingParams())], mailbox)
        pid = tmp_path / "pid"
        while not pid.exists():
            await asyncio.sleep(0.05)
        os.kill(int(pid.read_text()), signal.SIGKILL)
        with pytest.raises(EngineDead, match="exited unexpectedly"):
            await asyncio.wait_for(mailbox.get(), 30)
        await asyncio.wait_for(fatal.wait(), 30)
        with pytest.raises(EngineDead):
            await engine.add([EngineRequest("b", [1], SamplingParams())], OutputMailbox())
        engine.stop()

    asyncio.run(scenario())


def test_stop_ends_a_wedged_engine(tmp_path: Path) -> None:
    """A step that never returns does not keep the server from stopping: the process is terminated."""
    async def scenario() -> None:
        engine = double(tmp_path, HangingEngine)
        engine.start(asyncio.get_running_loop(), lambda: None)
        await engine.add([EngineRequest("a", [1], SamplingParams())], OutputMailbox())
        while not (tmp_path / "pid").exists():
            await asyncio.sleep(0.05)
        engine.stop(wait_s=0.5)
        assert not engine._process.is_alive()

    asyncio.run(scenario())


VOCAB = 151936  # the demo's (the bundled Qwen3 tokenizer's ids fit)


class GrammarCheckingEngine(StepFailsEngine):
    """Refuses a grammar request unless its compiled grammar is in the process's cache before it is added: the
    server must have shipped it (compiling here would stall every stream)."""

    vocab_size = VOCAB

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.grammars = shared_compiler(config.tokenizer, VOCAB, sorted(self.eos_token_ids))

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if len(self.grammars) != 1:
            raise ValueError(f"{len(self.grammars)} grammars cached before the request was added")
        super().add_request(request_id, prompt, params)


def test_grammars_are_shipped_to_the_engine_once(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = StructuredOutputParams(json=schema)

    async def scenario() -> None:
        engine = double(tmp_path, GrammarCheckingEngine)
        engine.start(asyncio.get_running_loop(), lambda: None)
        await until_ready(engine)
        engine.grammars.compile(spec)  # as the server does before queueing
        params = SamplingParams(structured_output=spec)
        shipped = await engine._grammars_to_ship([EngineRequest("x", [1], params), EngineRequest("y", [1], params)])
        assert list(shipped) == ["x"] and engine._shipped  # one payload for the two requests sharing the grammar
        engine._shipped.clear()
        await engine.add([EngineRequest("a", [1], params), EngineRequest("b", [1], params)], OutputMailbox())
        assert await engine._grammars_to_ship([EngineRequest("c", [1], params)]) == {}  # sent already
        engine.stop()

    asyncio.run(scenario())


def test_a_request_that_cannot_be_sent_fails_alone(tmp_path: Path) -> None:
    """A request the pipe cannot carry (here: params holding a lambda) is refused alone; the engine keeps serving
    (the sender thread survives it)."""
    async def scenario() -> None:
        engine = double(tmp_path, StepFailsEngine)
        engine.start(asyncio.get_running_loop(), lambda: None)
        params = SamplingParams()
        object.__setattr__(params, "unpicklable", lambda: None)
        with pytest.raises(RuntimeError, match="could not be sent"):
            await engine.add([EngineRequest("bad", [1], params)], OutputMailbox())
        mailbox = OutputMailbox()
        await engine.add([EngineRequest("good", [1], SamplingParams())], mailbox)
        (output,) = await mailbox.get()
        assert output.request_id == "good"
        engine.stop()

    asyncio.run(scenario())


class FreezeReportingEngine(StepFailsEngine):
    def stats(self) -> dict[str, int]:
        return {"frozen_objects": gc.get_freeze_count()}


def test_the_engine_process_freezes_its_startup_heap(tmp_path: Path) -> None:
    """By the time the engine reports ready, what its process built (imports, model) is out of the collector's
    reach, so full collections during steps do not walk it."""
    async def scenario() -> None:
        engine = double(tmp_path, FreezeReportingEngine)
        engine.start(asyncio.get_running_loop(), lambda: None)
        await until_ready(engine)
        assert engine.stats()["frozen_objects"] > 10_000  # the interpreter, torch, the engine's modules
        engine.stop()

    asyncio.run(scenario())


def test_a_tokenizer_the_server_cannot_load_fails_the_start(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model=str(tmp_path), tokenizer=str(tmp_path / "missing")),
                             engine_factory=StepFailsEngine)
        fatal = asyncio.Event()
        engine.start(asyncio.get_running_loop(), fatal.set)
        await asyncio.wait_for(fatal.wait(), 60)
        assert not engine.ready and "could not load the tokenizer" in str(engine.error)
        engine.stop()

    asyncio.run(scenario())
