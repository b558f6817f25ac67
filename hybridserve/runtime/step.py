"""StepPlan: everything the model runner needs for one step, as host data (what rank 0 would broadcast)."""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.layers.sampler import SamplingRow
from hybridserve.runtime.batch import ScheduledChunk


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk]
    samples: list[SamplingRow | None]  # per chunk: draw the next token after it (None = mid-prompt chunk)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint slot -> working slot), before
    page_restores: list[tuple[int, int]] = field(default_factory=list)  # (page footer -> working slot), before
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (working slot -> checkpoint slot), after
