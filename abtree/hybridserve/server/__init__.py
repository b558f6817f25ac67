"""The OpenAI-compatible HTTP server behind `hybridserve serve` (routes in app.py, the engine thread in
async_engine.py)."""
