"""The serving benchmark (`python -m benchmarks.serving`): `hybridserve serve` in a child process, driven by a load
generator over HTTP."""
