"""Tensor parallelism over torch.distributed: one process per rank, rank 0 the engine's own.

Rank 0 hosts the scheduler. Every call the engine makes on its ModelRunner that touches the model (warm-up, table
creation, graph capture, each step's `launch`) is first sent to the other ranks over a gloo control group (the
StepPlan is host data), and every rank then runs it on its own shard and its own slice of the caches; the
collectives inside the forward keep them in lockstep. Each rank samples from the same all-gathered logits with
the same seeded draws, so every rank appends the same tokens (the workers never read theirs back). Workers are
daemon processes: they end with the engine's process, and a dead rank makes the others' collectives fail after
`TIMEOUT` instead of hanging.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridserve.config import EngineConfig
from hybridserve.core.parallel import set_tensor_parallel_group
from hybridserve.runtime.control_channel import ControlChannel
from hybridserve.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)

TIMEOUT = datetime.timedelta(minutes=10)  # a collective waiting this long means a rank is gone
# NCCL settings a rank starts with unless its environment says otherwise. NVLink multicast (NVLS) is off, as in
# SGLang (`--enable-nccl-nvls` turns it on there; NCCL_NVLS_ENABLE=1 does here): its buffers cost GPU memory the
# planner does not count, and on shared hosts it can leave GPUs unusable after a crash.
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0"}


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous or a local server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The rank's own config: on CUDA the rank's local index on its node, counted from the configured GPU."""
    device = config.torch_device()
    if device.type == "cuda":
        local = rank % (config.tensor_parallel_size // config.nnodes)
        return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + local}")
    return config


def _node_ranks(config: EngineConfig) -> range:
    per_node = config.tensor_parallel_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def _address(config: EngineConfig) -> str:
    return f"tcp://{config.dist_init_addr}" if config.dist_init_addr else f"tcp://127.0.0.1:{free_local_port()}"


def set_nccl_defaults() -> None:
    """Apply NCCL_DEFAULTS where the environment leaves them unset (before NCCL reads them at its first use)."""
    for name, value in NCCL_DEFAULTS.items():
        os.environ.setdefault(name, value)


def init_group(rank: int, size: int, address: str, device: torch.device) -> ControlChannel:
    """Join the TP group (NCCL on CUDA, gloo on CPU), install it for the layers, and open the control channel."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_nccl_defaults()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=address, world_size=size,
                            rank=rank, timeout=TIMEOUT)
    set_tensor_parallel_group(rank, size, dist.group.WORLD)
    return ControlChannel(dist.new_group(backend="gloo", timeout=TIMEOUT))


def _spawn(ranks: range, address: str, config: EngineConfig) -> list[mp.Process]:
    local = len(_node_ranks(config))
    if config.torch_device().type == "cuda" and torch.cuda.device_count() < local:
        raise ValueError(f"{local} tensor-parallel ranks on this node need {local} GPUs; it has "
                         f"{torch.cuda.device_count()}")
    context = mp.get_context("spawn")
    workers = [context.Process(target=_worker_main, args=(rank, config.tensor_parallel_size, address, config),
                               daemon=True, name=f"hybridserve-tp{rank}") for rank in ranks]
    for worker in workers:
        worker.start()
    return workers


def start_workers(config: EngineConfig) -> tuple[list[mp.Process], ControlChannel]:
    """Node 0: spawn this node's other ranks and join the group as rank 0 (the other nodes' ranks join from
    `run_worker_node`)."""
    address = _address(config)
    workers = _spawn(_node_ranks(config)[1:], address, config)
    channel = init_group(0, config.tensor_parallel_size, address, rank_config(config, 0).torch_device())
    return workers, channel


def run_worker_node(config: EngineConfig) -> None:
    """A node other than 0: run its ranks (the first in this process) until rank 0 tells them to stop."""
    first, *others = _node_ranks(config)
    workers = _spawn(others, _address(config), config)
    _worker_main(first, config.tensor_parallel_size, _address(config), config)
    for worker in workers:
        worker.join()


def stop_workers(workers: list[mp.Process], channel: ControlChannel) -> None:
    try:
        channel.send(("stop", ()))
        dist.barrier(group=channel.group)  # every rank has the message before the group is torn down
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
        dist.destroy_process_group()
        set_tensor_parallel_group(0, 1, None)  # this process may build a single-rank engine next


def _worker_main(rank: int, size: int, address: str, config: EngineConfig) -> None:
    """A worker rank: build the runner on its shard, then make the calls rank 0 sends until told to stop."""
    config = rank_config(config, rank)
    if config.torch_device().type == "cpu":  # the node's ranks share its cores
        torch.set_num_threads(max(1, torch.get_num_threads() // len(_node_ranks(config))))
    channel = init_group(rank, size, address, config.torch_device())
    runner = ModelRunner(config, config.model, channel)
    while True:
        name, args = channel.receive()
        if name == "stop":
            dist.barrier(group=channel.group)
            break
        getattr(runner, name)(*args)
    dist.destroy_process_group()
