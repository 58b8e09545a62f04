"""A real MLflow tracking server on 127.0.0.1 for the tests: `mlflow server` with a sqlite backend and its
artifacts in a folder of the test session, on a free port, waited for until it answers /health. `kill()`
ends it at once (SIGKILL to its process group: the server and its uvicorn worker); `start()` brings it
back on the same port and backend."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path):
        self.root, self.port = Path(root), free_port()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job workers
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"mlflow server did not answer in {timeout:g} s: {(self.root / 'server.log').read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def pause(self, paused: bool) -> None:
        """SIGSTOP (a server that accepts connections and never answers) or SIGCONT."""
        os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
