"""`python -m benchmarks.offline MODE [options]`: hybridserve's LLM on one model (a random stand-in of ZAYA1-8B or
Ling-2.6-flash, or --model) in this process (`ab`: throughput runs of two builds, each in a process of its own).
`MODE --help` lists a mode's options."""
from __future__ import annotations

from benchmarks.cli import run_mode

MODES = {
    "throughput": ("benchmarks.offline.throughput", "tok/s per scenario against HF transformers and the decode "
                                                    "bandwidth floor; FP8, speculative and JSON-grammar runs"),
    "profile": ("benchmarks.offline.step_profile", "where one engine step's time goes: step times, torch.profiler "
                                                   "tables, the host's share"),
    "agreement": ("benchmarks.offline.agreement", "top-1 agreement with the fp32 oracle: FP8 vs bf16, or per Ling "
                                                  "lightning implementation"),
    "prefill-host": ("benchmarks.offline.prefill_host", "one eager prefill step: the host's queueing against the "
                                                        "device's time"),
    "ab": ("benchmarks.offline.ab", "throughput of the tree as is against the tree with a patch (or without one), "
                                    "alternating runs: medians and their ratio"),
}

if __name__ == "__main__":
    run_mode("offline", MODES)
