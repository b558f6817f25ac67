"""Data-parallel replicas (`--dp N`): N independent engines behind one HTTP server.

Each replica is an AsyncEngine (an engine process of its own: replicas never share an interpreter lock) with its own
device(s) (replica i takes GPUs i*tp .. (i+1)*tp - 1), caches and scheduler. A request group goes to one replica:
the one whose prefix cache most likely holds the longest page-aligned prefix of its prompt (the router remembers
which replica last took each prefix, by a hash chain over whole pages), otherwise the one with the fewest
outstanding tokens (prompt + max new tokens of its unfinished requests). The set answers the server exactly as one
AsyncEngine does.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Callable

from hybridserve.config import EngineConfig
from hybridserve.outputs import RequestOutput
from hybridserve.server.async_engine import AsyncEngine, EngineInfo, EngineRequest, OutputMailbox
from hybridserve.structured.compiler import GrammarCompiler

PREFIX_MEMORY = 1 << 16  # page-prefix hashes remembered for affinity (least recently placed forgotten first)


def replica_config(config: EngineConfig, replica: int) -> EngineConfig:
    """Replica i's config: on CUDA its first GPU is i * tensor_parallel_size."""
    device = config.torch_device()
    if device.type != "cuda":
        return config
    return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + replica * config.tensor_parallel_size}")


def prefix_hashes(token_ids: list[int], page_size: int) -> list[int]:
    """One hash per whole page of the prompt, each covering everything before it (a chain)."""
    hashes, running = [], 0
    for end in range(page_size, len(token_ids) + 1, page_size):
        running = hash((running, tuple(token_ids[end - page_size:end])))
        hashes.append(running)
    return hashes


class _CountingMailbox:
    """Forwards a group's outputs to its API call's mailbox and tells the set when each request finishes."""

    def __init__(self, mailbox: OutputMailbox, finished: Callable[[str], None]):
        self._mailbox, self._finished = mailbox, finished

    def put(self, output: RequestOutput, delta: bool) -> None:
        if output.finished:
            self._finished(output.request_id)
        self._mailbox.put(output, delta)

    def interrupt(self, reason: BaseException) -> None:
        self._mailbox.interrupt(reason)


class ReplicaSet:
    def __init__(self, config: EngineConfig, replicas: int, chat_template: str | None = None):
        if replicas < 1:
            raise ValueError(f"--dp {replicas}: at least one replica is needed")
        self.config = config
        self.replicas = [AsyncEngine(replica_config(config, i), chat_template) for i in range(replicas)]
        self._outstanding = [0] * replicas  # prompt + max new tokens of each replica's unfinished requests
        self._placed: dict[str, tuple[int, int]] = {}  # request id -> (replica, its outstanding tokens)
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # page-prefix hash -> replica that last took it

    # --- the AsyncEngine surface the server uses -----------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_fatal: Callable[[], None]) -> None:
        for replica in self.replicas:
            replica.start(loop, on_fatal)

    def stop(self, wait_s: float = 30) -> None:
        for replica in self.replicas:
            replica.stop(wait_s)

    @property
    def info(self) -> EngineInfo | None:
        infos = [replica.info for replica in self.replicas]
        return None if any(i is None for i in infos) else infos[0]

    @property
    def error(self) -> BaseException | None:
        return next((replica.error for replica in self.replicas if replica.error is not None), None)

    @property
    def ready(self) -> bool:
        return all(replica.ready for replica in self.replicas)

    @property
    def grammars(self) -> GrammarCompiler:
        """The replicas' grammar compiler (one per process and tokenizer: every replica shares it)."""
        return self.replicas[0].grammars

    def stats(self) -> dict[str, int]:
        """Every replica's stats summed (gauges and counters alike)."""
        total: dict[str, int] = {}
        for replica in self.replicas:
            for key, value in replica.stats().items():
                total[key] = total.get(key, 0) + value
        return total

    async def add(self, requests: list[EngineRequest], mailbox: OutputMailbox) -> None:
        index = self.place(requests)
        for request in requests:
            cost = len(request.prompt_token_ids) + (request.params.max_tokens or 0) * request.params.n
            self._placed[request.request_id] = (index, cost)
            self._outstanding[index] += cost
        try:
            await self.replicas[index].add(requests, _CountingMailbox(mailbox, self._finished))
        except BaseException:
            for request in requests:
                self._finished(request.request_id)
            raise

    async def flush_cache(self) -> bool:
        """Every replica's prefix cache emptied; False if some replica has requests in flight (it keeps its)."""
        return all(await asyncio.gather(*(replica.flush_cache() for replica in self.replicas)))

    def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            if request_id in self._placed:
                by_replica.setdefault(self._placed[request_id][0], []).append(request_id)
                self._finished(request_id)
        for index, ids in by_replica.items():
            self.replicas[index].abort(ids)

    # --- placement --------------------------------------------------------------------------------------------
    def place(self, requests: list[EngineRequest]) -> int:
        """The replica for a request group: prefix affinity first, then the fewest outstanding tokens."""
        hashes = prefix_hashes(requests[0].prompt_token_ids, self.config.page_size)
        index = next((self._prefixes[h] for h in reversed(hashes) if h in self._prefixes), None)
        if index is None:
            index = min(range(len(self.replicas)), key=lambda i: (self._outstanding[i], i))
        for h in hashes:
            self._prefixes[h] = index
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > PREFIX_MEMORY:
            self._prefixes.popitem(last=False)
        return index

    def _finished(self, request_id: str) -> None:
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            self._outstanding[placed[0]] -= placed[1]
