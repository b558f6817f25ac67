"""ControlChannel: how rank 0's runner hands the other tensor-parallel ranks each call to make. Its own module so
that the runner (which sends) and `runtime.tensor_parallel` (which starts the ranks and runs a runner in each)
both import it without importing each other."""
from __future__ import annotations

import torch
import torch.distributed as dist


class ControlChannel:
    """Rank 0 -> all ranks: the runner calls to make, as pickled host objects over a gloo group."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (the cache budget every rank can afford)."""
        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())
