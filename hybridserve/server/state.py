"""ServerState: what every route shares (the engine, metrics, the served model's name) and the readiness gate."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hybridserve.server.async_engine import AsyncEngine, EngineInfo
from hybridserve.server.errors import APIError, not_ready
from hybridserve.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))

    def info(self) -> EngineInfo:
        """The loaded model, or a 503 while it loads (or after the engine failed)."""
        if self.engine.error is not None:
            raise not_ready(f"the engine has failed ({self.engine.error}); restart the server")
        if self.engine.info is None:
            raise not_ready("the model is still loading; retry when GET /health returns 200")
        return self.engine.info

    def model(self, requested: str | None) -> EngineInfo:
        """`info()` for a request naming `requested` (None: the served model); unknown names are a 404."""
        info = self.info()
        if requested is not None and requested != self.model_name:
            raise APIError(f"the model '{requested}' does not exist; this server serves '{self.model_name}'",
                           status=404, type="not_found_error", param="model", code="model_not_found")
        return info
