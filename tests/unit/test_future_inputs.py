"""`core.batch.resolve_future_inputs`: the previous step's draws written into the input rows that wait for them, by
one copy where the rows and their sources are runs of consecutive indices (no index uploaded), else by a gather
through an index uploaded or given."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from hybridserve.core import batch

PREVIOUS = torch.tensor([11, 12, 13, 14])


def _resolved(rows: list[int], sources: list[int], previous: torch.Tensor | None = PREVIOUS, **kwargs) -> list[int]:
    ids = torch.zeros(6, dtype=torch.long)
    batch.resolve_future_inputs(ids, rows, sources, previous, **kwargs)
    return ids.tolist()


def test_consecutive_runs_are_one_copy_without_an_upload():
    with mock.patch.object(batch, "upload", side_effect=AssertionError("an index was uploaded")):
        assert _resolved([2, 3, 4], [1, 2, 3]) == [0, 0, 12, 13, 14, 0]
        assert _resolved([5], [0]) == [0, 0, 0, 0, 0, 11]


def test_other_rows_are_gathered():
    assert _resolved([0, 2], [3, 1]) == [14, 0, 12, 0, 0, 0]  # the rows are not a run
    assert _resolved([1, 2], [2, 0]) == [0, 13, 11, 0, 0, 0]  # the sources are not
    given = (torch.tensor([4, 0]), torch.tensor([0, 0]))
    with mock.patch.object(batch, "upload", side_effect=AssertionError("an index was uploaded")):
        assert _resolved([4, 0], [0, 0], index=given) == [11, 0, 0, 0, 11, 0]


def test_no_rows_need_no_previous_step_and_rows_without_one_are_refused():
    assert _resolved([], [], previous=None) == [0] * 6
    with pytest.raises(RuntimeError, match="drew nothing"):
        _resolved([0], [0], previous=None)
