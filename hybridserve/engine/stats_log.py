"""The periodic stats line, as vLLM logs one while it is busy: prompt and generation throughput over the interval,
running and waiting requests, KV-page and state-slot use, the prefix-cache hit rate (and the draft acceptance
with speculative decoding). Made from successive snapshots of `LLMEngine.stats()`, so the server can log it from
the stats its engine process sends after every step."""
from __future__ import annotations


def _share(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


class StatsLine:
    def __init__(self):
        self._last: tuple[float, dict[str, int]] | None = None

    def line(self, stats: dict[str, int], now: float) -> str | None:
        """The line for the time since the previous call; None for the first call and for an interval in which
        nothing ran, waited or was computed (an idle server logs nothing)."""
        last, self._last = self._last, (now, dict(stats))
        if last is None or not stats:
            return None
        elapsed, before = max(now - last[0], 1e-9), last[1]

        def delta(key: str) -> int:
            return stats.get(key, 0) - before.get(key, 0)

        prompt, generated = delta("prompt_tokens"), delta("generation_tokens")
        running, waiting = stats.get("running", 0), stats.get("waiting", 0)
        if not (prompt or generated or running or waiting):
            return None
        text = (f"prompt throughput {prompt / elapsed:.1f} tok/s, generation throughput {generated / elapsed:.1f} "
                f"tok/s, running {running} reqs, waiting {waiting} reqs, KV cache "
                f"{_share(stats.get('kv_pages_used', 0), stats.get('kv_pages_total', 0))}, state slots "
                f"{_share(stats.get('state_slots_used', 0), stats.get('state_slots_total', 0))}, prefix-cache hit "
                f"rate {_share(delta('prefix_cache_hit_tokens'), delta('prefix_cache_query_tokens'))}")
        if delta("spec_draft_tokens"):
            text += f", draft acceptance {_share(delta('spec_accepted_tokens'), delta('spec_draft_tokens'))}"
        return text
