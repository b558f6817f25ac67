"""The OpenAI-compatible HTTP server behind `hybridserve serve` (routes in app.py; the engine runs in a
process of its own, engine_process.py, behind async_engine.py)."""
