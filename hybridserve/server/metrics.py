"""Prometheus metrics under the `hybridserve:` prefix (as vLLM uses `vllm:`).

Engine gauges and counters are read from the engine's latest stats at scrape time (nothing to keep in sync);
latency histograms are observed by the API layer from request arrival and output times. Every sample carries a
`model_name` label (the served name), as vLLM's do, so dashboards over several servers can tell them apart.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridserve.outputs import RequestOutput

PREFIX = "hybridserve:"

# (metric name, engine stats key, help)
_GAUGES = [
    ("num_requests_running", "running", "Requests in the running batch."),
    ("num_requests_waiting", "waiting", "Requests waiting to be admitted."),
    ("kv_cache_pages_used", "kv_pages_used", "KV-cache pages held by requests."),
    ("kv_cache_pages_cached", "kv_pages_cached", "KV-cache pages held only by the prefix cache (evictable)."),
    ("kv_cache_pages_total", "kv_pages_total", "KV-cache pages in the pool."),
    ("state_slots_used", "state_slots_used", "Recurrent-state slots held by requests."),
    ("state_slots_cached", "state_slots_cached", "State slots held only by the prefix cache (evictable)."),
    ("state_slots_total", "state_slots_total", "Recurrent-state slots in the pool."),
    # Models with sliding-window layers only: their KV pages live in a pool of their own.
    ("kv_cache_window_pages_total", "kv_window_pages_total", "Pages in the sliding-window layers' KV pool."),
    ("kv_cache_window_pages_free", "kv_window_pages_free", "Free pages in the sliding-window layers' KV pool."),
    ("kv_cache_window_pages_cached", "kv_window_pages_cached",
     "Sliding-window KV pages held by the prefix cache (requests may hold them too)."),
]
_COUNTERS = [
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("generation_tokens", "generation_tokens", "Generated tokens."),
    ("prefix_cache_queries", "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache."),
    ("num_preemptions", "preemptions", "Requests preempted (to be recomputed) for lack of pages or slots."),
    ("spec_decode_num_drafts", "spec_verify_rows", "Speculative decoding: request-steps that verified drafts."),
    ("spec_decode_num_draft_tokens", "spec_draft_tokens", "Speculative decoding: draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Speculative decoding: draft tokens accepted."),
]
# (metric name, used key, total key, help)
_USAGE = [
    ("kv_cache_usage_perc", "kv_pages_used", "kv_pages_total", "Fraction of KV-cache pages held by requests."),
    ("state_cache_usage_perc", "state_slots_used", "state_slots_total", "Fraction of state slots held by requests."),
]


class _EngineStats(Collector):
    def __init__(self, stats: Callable[[], dict[str, int]], model_name: str):
        self._stats, self._model = stats, model_name

    def _one(self, family: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, value: float) -> Metric:
        metric = family(PREFIX + name, doc, labels=["model_name"])
        metric.add_metric([self._model], value)
        return metric

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, key, doc in _GAUGES:
            if key in stats:
                yield self._one(GaugeMetricFamily, name, doc, stats[key])
        for name, used, total, doc in _USAGE:
            if total in stats:
                yield self._one(GaugeMetricFamily, name, doc, stats[used] / max(stats[total], 1))
        for name, key, doc in _COUNTERS:
            if key in stats:
                yield self._one(CounterMetricFamily, name, doc, stats[key])
        if stats.get("spec_verify_rows"):
            rows, drafts, accepted = (stats[k] for k in ("spec_verify_rows", "spec_draft_tokens",
                                                         "spec_accepted_tokens"))
            yield self._one(GaugeMetricFamily, "spec_decode_acceptance_rate", "Speculative decoding: accepted / "
                            "verified draft tokens, since start.", accepted / max(drafts, 1))
            yield self._one(GaugeMetricFamily, "spec_decode_mean_accept_length", "Speculative decoding: tokens a "
                            "verifying request gains per step (accepted drafts + the bonus token), since start.",
                            (accepted + rows) / rows)
        if "prefix_cache_hit_tokens" in stats:
            hits = CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache, by "
                                       "layer kind: attention = KV matched; state = also restorable (usable hit).",
                                       labels=["model_name", "layer_kind"])
            hits.add_metric([self._model, "attention"], stats["prefix_cache_kv_match_tokens"])
            hits.add_metric([self._model, "state"], stats["prefix_cache_hit_tokens"])
            yield hits


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict[str, int]], model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStats(engine_stats, model_name))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of one sequence.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token of a request.")

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latencies of one engine request (one prompt, n sequences), observed as its delta outputs reach the event
    loop (what a client sees); deltas that arrive coalesced count each of their tokens."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.first_token: float | None = None
        self.seen: dict[int, tuple[int, float]] = {}  # sequence index -> (tokens seen, time of the last one)

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        for completion in output.outputs:
            count, last = self.seen.get(completion.index, (0, now))
            new = len(completion.token_ids)
            if new == 0:
                continue
            gaps = new - 1 if count == 0 else new  # a sequence's first token closes no gap
            if self.first_token is None:
                self.first_token = now
                self.metrics.ttft.observe(now - self.arrival)
            for _ in range(gaps):  # one sample per token; tokens that arrived together share the interval
                self.metrics.itl.observe((now - last) / new)
            self.seen[completion.index] = (count + new, now)
        if output.finished:
            self.metrics.e2e.observe(now - self.arrival)
