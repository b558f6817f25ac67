"""Data-parallel replicas (`--dp`): placement by prefix affinity, then least outstanding tokens; a two-replica
server answers with the same greedy tokens as one replica and hits its prefix cache for a repeated prefix."""
from __future__ import annotations

from hybridserve.config import EngineConfig
from hybridserve.sampling import SamplingParams
from hybridserve.server.async_engine import EngineRequest
from hybridserve.server.replicas import ReplicaSet, prefix_hashes
from tests.server.conftest import SMALL_CACHE, serve


def _request(request_id: str, prompt: list[int], max_tokens: int = 10) -> list[EngineRequest]:
    return [EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens))]


def test_placement_prefers_the_replica_with_the_prefix_then_the_least_loaded():
    replicas = ReplicaSet(EngineConfig(model="/unused", device="cpu", page_size=4), 3)
    a = list(range(3, 23))  # 5 whole pages
    assert replicas.place(_request("a", a)) == 0  # all idle: the first
    replicas._outstanding = [100, 5, 50]
    assert replicas.place(_request("b", [9] * 12)) == 1  # no known prefix: the least loaded
    assert replicas.place(_request("c", a[:13] + [1, 2, 3])) == 0  # shares 3 pages with "a": its replica
    assert replicas.place(_request("d", a[:3] + [7] * 9)) == 1  # under one whole page in common: by load
    replicas._outstanding = [0, 0, 0]
    assert replicas.place(_request("e", [9] * 16)) == 1  # "b"'s first 3 pages: its replica, though all are idle
    assert prefix_hashes(a, 4)[:3] == prefix_hashes(a[:13], 4)  # a chain: each hash covers all before it


def test_outstanding_tokens_follow_requests_until_they_finish_or_abort():
    replicas = ReplicaSet(EngineConfig(model="/unused", device="cpu", page_size=4), 2)
    for request in _request("x", [1] * 8, 4) + _request("y", [2] * 8, 6):
        replicas._placed[request.request_id] = (0, 12 if request.request_id == "x" else 14)
    replicas._outstanding = [26, 0]
    replicas._finished("x")
    assert replicas._outstanding == [14, 0]
    replicas.abort(["y", "unknown"])  # unknown ids are ignored
    assert replicas._outstanding == [0, 0] and not replicas._placed


def test_two_replicas_answer_like_one(zaya_dir, tmp_path_factory):
    args = [str(zaya_dir), "--dtype", "float32", "--served-model-name", "tiny-zaya", "--page-size", "4", *SMALL_CACHE]
    prompts = [[3 + (7 * i + j) % 100 for j in range(9 + 5 * i)] for i in range(6)]
    results = {}
    for dp in (1, 2):
        server = serve([*args, "--dp", str(dp)], tmp_path_factory)
        try:
            client = server.client()
            outs = [client.completions.create(model="tiny-zaya", prompt=p, max_tokens=8, temperature=0)
                    for p in prompts]
            results[dp] = [o.choices[0].text for o in outs]
            again = client.completions.create(model="tiny-zaya", prompt=prompts[5] + [4, 5], max_tokens=8,
                                              temperature=0)
            assert again.usage.completion_tokens == 8
            metrics = server.metrics()
        finally:
            server.stop()
        assert metrics['hybridserve:prefix_cache_hits_total{layer_kind="state"}'] >= 4 * (len(prompts[5]) // 4 - 1)
    assert results[1] == results[2]
