"""`hybridserve serve` in a child process on a free localhost port, its log in a file, ready once /health says so:
what the serving benchmark and the server tests start."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from hybridserve.runtime.tensor_parallel import free_local_port

ROOT = Path(__file__).resolve().parents[2]  # the folder holding this hybridserve package


def _stop_with_parent() -> None:
    """In the server's child process: have Linux send it SIGTERM when its parent dies, even by SIGKILL (a timeout),
    so that no server outlives its benchmark or test run holding the GPU or a port."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


class ServerProcess:
    """Started on construction with this hybridserve first on the child's path; `env` adds to the environment."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [sys.executable, "-m", "hybridserve.cli", "serve", *args, "--host", "127.0.0.1",
                        "--port", str(self.port)]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would block the server
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONPATH": path, **(env or {})},
                                            preexec_fn=_stop_with_parent)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float) -> None:
        """Poll GET /health (503 while loading and warming up, 200 once it serves), as a readiness probe does;
        RuntimeError with the log's tail if the server exits or is not ready in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM (a graceful shutdown), SIGKILL if it has not exited within `timeout_s`."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
