"""The engine thread's contract, with an engine double whose steps fail (no real engine fails on demand)."""
from __future__ import annotations

import asyncio

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

    def __init__(self, config: EngineConfig):
        self.pending: list[str] = []
        self.steps = 0
        StepFailsEngine.instance = self

    def stats(self) -> dict[str, int]:
        return {"running": len(self.pending)}

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

    asyncio.run(scenario())
