"""Offline benchmarks (`python -m benchmarks.offline MODE`): hybridserve's `LLM` in the benchmark's own process."""
