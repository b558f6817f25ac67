"""The persistent device page tables: each step writes only what changed in its rows (new pages, a new row's slot,
window entries released back to the dummy page), and a step where nothing changed uploads nothing at all."""
from __future__ import annotations

from unittest import mock

import torch

from hybridserve.core.batch import HostPack, PageTables
from hybridserve.core.chunk import ScheduledChunk


def _row(table_row: int, pages: list[int], slot: int, window: list[int] | None = None) -> ScheduledChunk:
    return ScheduledChunk([1], 0, pages, slot, True, [0], table_row=table_row, window_page_ids=window)


def test_only_changes_are_uploaded() -> None:
    tables = PageTables(3, 6, torch.device("cpu"), window=True)
    uploads = []
    original = HostPack.upload
    with mock.patch.object(HostPack, "upload", lambda pack, device: (uploads.append(1), original(pack, device))[1]):
        pages, window = [4, 7], [4, 7]
        tables.upload_updates([_row(0, pages, 5, window), _row(2, [9], 6, [9])])  # two new rows
        assert len(uploads) == 1
        for _ in range(3):  # decode steps within the rows' last pages: nothing to write
            tables.upload_updates([_row(0, pages, 5, window), _row(2, [9], 6, [9])])
        assert len(uploads) == 1
        pages.append(8)  # row 0 gains a page; its first page falls out of the window (released: the dummy 0)
        window[:] = [0, 7, 8]
        tables.upload_updates([_row(0, pages, 5, window), _row(2, [9], 6, [9])])
        assert len(uploads) == 2
    assert tables.full.pages[0, :4].tolist() == [4, 7, 8, 0] and tables.full.pages[2, :2].tolist() == [9, 0]
    assert tables.window.pages[0, :4].tolist() == [0, 7, 8, 0]
    assert tables.slots.tolist() == [5, 0, 6, 0]  # row 1 unused, row 3 the dummy row
    tables.reset([2])  # row 2 handed to a new sequence: its pages and slot are written again
    tables.upload_updates([_row(2, [3], 1, [3])])
    assert tables.full.pages[2, 0].item() == 3 and tables.slots[2].item() == 1
