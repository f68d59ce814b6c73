"""A real Ray head for the jobs tests: `ray start --head --block` on free loopback ports, stopped by pid.

Token auth is on with a per-test token (never ~/.ray/auth_token), the dashboard/job server listens on
127.0.0.1 only, and everything lives in a private temp dir (RAY_NOTES P9: never touch another Ray here).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import requests

from raydl.bench.fault_cluster import poll
from raydl.bench.procs import cmdline, table
from tests.helpers import free_port, stop_processes

VENV_BIN = str(Path(sys.executable).parent)   # the job's `python` must be this venv's


@dataclass
class Head:
    proc: subprocess.Popen
    address: str           # job server URL
    gcs_port: int
    token: str
    token_file: Path
    log: Path

    def client_env(self, *, token_env: bool) -> dict[str, str]:
        """Env for a client subprocess, with no address or token from outside. token_env: the token in
        RAY_AUTH_TOKEN plus RAY_AUTH_MODE=token, without which plain `ray job` does not send it (RAY_NOTES 5)."""
        drop = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
        if token_env:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        return env


def short_tmp_dir() -> Path:
    """Ray's sockets live under <temp-dir>/session_<date>_<pid>/sockets/ and AF_UNIX paths are capped at
    107 bytes: pytest's tmp_path is too long, so use a short dir under RAY_TMPDIR (or /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="h", dir=os.environ.get("RAY_TMPDIR", "/tmp")))
    assert len(str(path)) <= 40, f"{path} is too long for Ray's socket paths: set RAY_TMPDIR to a short dir"
    return path


def start_head(tmp: Path, *, num_cpus: int, env: dict[str, str] | None = None,
               autoscaling_config: Path | None = None, gcs_port: int | None = None, timeout_s: float = 60) -> Head:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "ray").mkdir(exist_ok=True)
    token = secrets.token_hex(16)
    token_file = tmp / "token"
    token_file.write_text(token + "\n")
    gcs_port, dash_port = gcs_port or free_port(), free_port()
    head_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    head_env.update(PATH=f"{VENV_BIN}:{head_env['PATH']}", RAY_TMPDIR=str(tmp), RAY_AUTH_MODE="token",
                    RAY_AUTH_TOKEN=token,
                    # SIGTERM drains the node for 30 s by default: nothing here needs draining.
                    RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="1", **(env or {}))
    cmd = [f"{VENV_BIN}/ray", "start", "--head", "--block", f"--port={gcs_port}", f"--dashboard-port={dash_port}",
           "--dashboard-host=127.0.0.1", f"--num-cpus={num_cpus}", f"--temp-dir={tmp}", "--disable-usage-stats",
           # Fixed defaults (agent 52365, client 10001, ...) collide with other Rays on a shared machine:
           # a head whose agent cannot bind answers HTTP but never runs a job ("No available agent").
           *(f"--{name}={free_port()}" for name in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                    "ray-client-server-port", "metrics-export-port",
                                                    "runtime-env-agent-port"))]
    if autoscaling_config:
        cmd.append(f"--autoscaling-config={autoscaling_config}")
    log = tmp / "head.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=head_env, stdout=out, stderr=subprocess.STDOUT)
    head = Head(proc, f"http://127.0.0.1:{dash_port}", gcs_port, token, token_file, log)
    try:
        _wait_ready(head, timeout_s)
    except BaseException:
        stop_head(head)
        raise
    return head


def alive_nodes(head: Head) -> list[dict]:
    """Alive nodes as the state API lists them (the dashboard learns of a node a few seconds after it starts)."""
    r = requests.get(f"{head.address}/api/v0/nodes", params={"limit": 100}, timeout=10,
                     headers={"Authorization": f"Bearer {head.token}"})
    r.raise_for_status()
    return [n for n in r.json()["data"]["result"]["result"] if n["state"] == "ALIVE"]


def _wait_ready(head: Head, timeout_s: float) -> None:
    """Until the head's own node is listed: before that the job server answers but cannot run jobs."""
    def node_listed() -> bool:
        if head.proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.proc.returncode}:\n{head.log.read_text()[-3000:]}")
        try:
            return bool(alive_nodes(head))
        except requests.RequestException:   # not listening yet, or answering 5xx while starting
            return False
    poll(f"Ray head at {head.address} listing its node", node_listed, timeout_s,
         lambda: head.log.read_text()[-3000:], every_s=0.5)


def stop_head(head: Head, timeout_s: float = 60) -> int:
    """SIGTERM the `ray start --block` we started and wait; then the same for anything still running from this
    head's private temp dir: fake-provider nodes are raylets started by the head's autoscaler with
    shutdown_at_exit=False, and they can outlive it. Returns how many such leftovers were stopped."""
    if head.proc.poll() is None:
        head.proc.terminate()
        try:
            head.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            head.proc.kill()
            head.proc.wait()
    # Processes whose command line names this head's private temp dir.
    leftovers = [pid for pid in table() if f"{head.log.parent}/" in cmdline(pid)]
    stop_processes(leftovers, grace_s=15)
    return len(leftovers)
