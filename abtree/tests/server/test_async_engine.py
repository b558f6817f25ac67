"""The engine thread's contract, with an engine double whose steps fail (no real engine fails on demand)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hybridserve.config import EngineConfig
from hybridserve.demo import bundled_tokenizer_dir
from hybridserve.outputs import CompletionOutput, RequestOutput
from hybridserve.sampling import SamplingParams
from hybridserve.server import async_engine
from hybridserve.server.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineRequest,
    OutputMailbox,
)


class StepFailsEngine:
    """Validates prompts like the engine, produces one output per request, then fails on the next step."""

    model_dir, max_model_len, vocab_size = "double", 64, 100
    runner = SimpleNamespace(model=object(), device="cpu", dtype="float32")

    def __init__(self, config: EngineConfig):
        self.pending: list[str] = []
        self.steps = 0
        self.shut_down = False
        StepFailsEngine.instance = self

    def stats(self) -> dict[str, int]:
        return {"running": len(self.pending)}

    def shutdown(self) -> None:
        self.shut_down = True

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
        return [RequestOutput(rid, None, [1], [CompletionOutput(0, "x", [5])]) for rid in self.pending]


def test_groups_are_atomic_outputs_arrive_and_a_failure_reaches_everyone(monkeypatch):
    monkeypatch.setattr(async_engine, "LLMEngine", StepFailsEngine)

    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model="unused-fake-engine", tokenizer=str(bundled_tokenizer_dir())))
        fatal = asyncio.Event()
        engine.start(asyncio.get_running_loop(), fatal.set)
        params = SamplingParams()
        with pytest.raises(ValueError, match="empty"):  # queued before the model loaded; the group is refused whole
            await engine.add([EngineRequest("a", [1], params), EngineRequest("b", [], params)], OutputMailbox())
        mailbox = OutputMailbox()
        await engine.add([EngineRequest("c", [1], params)], mailbox)
        (output,) = await mailbox.get()
        assert output.request_id == "c" and engine.info.max_model_len == 64
        with pytest.raises(EngineDead, match="boom"):
            await mailbox.get()
        await asyncio.wait_for(fatal.wait(), 30)
        with pytest.raises(EngineDead):
            await engine.add([EngineRequest("d", [1], params)], OutputMailbox())
        assert not engine.ready
        engine.stop()
        assert StepFailsEngine.instance.pending == ["c"]  # "a" of the refused group was taken back
        assert StepFailsEngine.instance.shut_down  # the thread's end stops the engine (its TP workers)

    asyncio.run(scenario())


def test_a_request_that_fails_in_the_engine_ends_alone(zaya_dir, monkeypatch):
    """The real engine with a failure injected into one request's sampling: that request's call gets its error,
    the other call finishes, and the engine thread keeps serving."""
    from hybridserve.layers.sampler import Sampler

    draw_rows = Sampler._draw_rows

    def failing(self, logits, rows):
        if any(row.seed == 666 for row in rows):
            raise RuntimeError("injected sampling failure")
        return draw_rows(self, logits, rows)

    monkeypatch.setattr(Sampler, "_draw_rows", failing)

    async def finish(mailbox: OutputMailbox) -> RequestOutput:
        while True:
            for output in await mailbox.get():
                if output.finished:
                    return output

    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model=str(zaya_dir), device="cpu", dtype="float32", use_tqdm=False,
                                          kv_cache_memory_bytes=64 << 20))
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
