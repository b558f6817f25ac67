"""The pinned staging buffers behind the CUDA graphs' static inputs (core/staging.py): a buffer is never handed out
twice in a row, and never written again before the device has run the copy that last read it.

Issue 32: two twins used in turn, with no event, let the fill of a long prompt's chunk N + 2 overwrite chunk N's
inputs before their copy ran (chunk steps draw nothing, so the engine never waits for them). Here a stand-in event
plays a device that lags without bound: an event recorded after a copy stays pending until the host waits on it.
A buffer handed out with a pending event, or handed out twice in a row, fails the tests.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.core.staging import StagingBuffers
from hybridserve.runtime.cuda_graphs import DecodeGraphs, capture_sizes
from hybridserve.runtime.prefill_graphs import PrefillGraphs

CPU = torch.device("cpu")


class LaggingDevice:
    """Events of a device that runs a queued copy only once the host waits for it."""

    def __init__(self) -> None:
        self.pending: set[int] = set()  # ids of events recorded and not waited on
        self.waits = 0

    def new_event(self) -> LaggingDevice.Event:
        return LaggingDevice.Event(self)

    class Event:
        def __init__(self, device: LaggingDevice) -> None:
            self.device = device

        def record(self, stream=None) -> None:
            self.device.pending.add(id(self))

        def synchronize(self) -> None:
            if id(self) in self.device.pending:
                self.device.waits += 1
            self.device.pending.discard(id(self))


class CheckedStaging(StagingBuffers):
    """StagingBuffers over a LaggingDevice that records each handed-out buffer and whether its copy was still
    pending when the host got it back."""

    def __init__(self, nbytes: int, count: int = 2) -> None:
        self.lag = LaggingDevice()
        super().__init__(nbytes, CPU, count, new_event=self.lag.new_event)
        self.handed: list[int] = []  # index of each buffer handed out, in order
        self.reused_pending = 0
        self.copies = 0

    def take(self) -> torch.Tensor:
        buffer = super().take()
        index = next(i for i, b in enumerate(self.buffers) if b is buffer)
        if id(self._events[index]) in self.lag.pending:  # the device has not read it yet
            self.reused_pending += 1
        self.handed.append(index)
        return buffer

    def copy_to(self, target: torch.Tensor) -> None:
        self.copies += 1
        super().copy_to(target)


def test_buffers_alternate_and_wait_for_their_last_copy() -> None:
    staging = CheckedStaging(8, count=3)
    target = torch.zeros(8, dtype=torch.uint8)
    for step in range(7):
        buffer = staging.take()
        buffer.fill_(step)
        staging.copy_to(target)
        assert torch.equal(target, torch.full((8,), step, dtype=torch.uint8))
    assert staging.handed == [0, 1, 2, 0, 1, 2, 0]
    assert staging.reused_pending == 0
    # Each reuse waited for the one copy pending on that buffer: steps 3..6 reuse buffers copied 3 steps before.
    assert staging.lag.waits == 4
    assert len(staging.lag.pending) == 3  # the last three copies, still "queued"


def test_a_buffer_never_copied_is_handed_out_without_a_wait() -> None:
    staging = CheckedStaging(4)
    staging.take()
    staging.take()  # the first buffer was never copied: its event guards nothing
    assert staging.lag.waits == 0
    with pytest.raises(ValueError, match="two buffers"):
        StagingBuffers(4, CPU, count=1)


def _llm(directory, **options) -> LLM:
    return LLM(str(directory), use_tqdm=False, device="cpu", dtype="float32", page_size=4, max_running_requests=8,
               chunked_prefill_size=8, **options)


def test_overlapped_engine_never_refills_a_buffer_before_its_copy(zaya_dir) -> None:
    """A long chunked prompt (its chunk steps draw nothing) beside short ones, overlapped, through the prefill and
    decode graphs' static inputs (CPU: the same forward, eager): every fill gets another buffer than the fill
    before, each after the copy that last read it has run, and the tokens are the eager engine's."""
    eager, graphed = _llm(zaya_dir), _llm(zaya_dir)
    runner, engine = graphed.engine.runner, graphed.engine
    assert not engine.config.disable_overlap_schedule
    runner.prefill_graphs = PrefillGraphs(runner.model, runner.tables, engine.config.page_size,
                                          engine.max_model_len, [16, 32], 3, runner.device, capture=False)
    runner.graphs = DecodeGraphs(runner.model, runner.tables, engine.config.page_size, engine.max_model_len,
                                 capture_sizes(4), runner.device, capture=False)
    stagings = []
    for graphs in (runner.prefill_graphs, runner.graphs):
        graphs.staging = CheckedStaging(graphs.staging.buffers[0].numel())
        stagings.append(graphs.staging)
    gen = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(3, 100, (n,), generator=gen).tolist()} for n in (61, 59, 5, 3)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    for inputs in (prompts[:1], prompts[1:]):  # alone (8 chunk steps, one draw), then another beside short prompts
        want, have = eager.generate(inputs, params), graphed.generate(inputs, params)
        assert [r.outputs[0].token_ids for r in want] == [r.outputs[0].token_ids for r in have]
    prefill, decode = stagings
    assert len(prefill.handed) >= 12 and len(decode.handed) >= 8
    for staging in stagings:
        assert staging.copies == len(staging.handed)  # one copy per fill
        assert all(a != b for a, b in zip(staging.handed, staging.handed[1:]))
        assert staging.reused_pending == 0
    assert prefill.lag.waits >= 10  # the lagging device held the host back at every reuse
