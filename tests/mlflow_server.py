"""A real MLflow tracking server on 127.0.0.1 for tests (sqlite backend, artifacts served from a temp dir)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 240.0   # about 70 s on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "MlflowServer":
        mlflow = str(Path(sys.executable).parent / "mlflow")
        self.log = (self.root / "mlflow-server.log").open("w")
        # Its own process group: `mlflow server` runs uvicorn (and its workers) under it, all stopped together.
        self.proc = subprocess.Popen([mlflow, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                                      "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                                      "--artifacts-destination", str(self.root / "artifacts")],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "MLFLOW_ENABLE_TELEMETRY": "false",
                                          # its job runner (7 more processes) serves nothing a test uses
                                          "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)   # polling a starting server, bounded by the deadline
        self.__exit__()
        raise RuntimeError(f"mlflow server did not answer within {START_TIMEOUT_S:g} s: "
                           f"{(self.root / 'mlflow-server.log').read_text()[-2000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
