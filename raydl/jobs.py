"""Ray Job Submission for raydl: find the cluster and its token, package the checkout, submit, follow.

`raydl submit` and `raydl jobs` are thin CLIs over this module. Everything a user can get wrong
(address, token, job id, working directory) becomes a `JobsError` (exit code 2) that says what was
tried and how to fix it; Ray's own exceptions never reach the user as a traceback.

Token auth (RAY_NOTES 5): a Ray 2.60 client sends the token only when RAY_AUTH_MODE=token is set in
*its* environment, so raydl finds the token itself and always sends it as a Bearer header.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO

from raydl.errors import RaydlError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Entry points that plain `ray job submit` can run too; they call the same CLI functions.
ENTRYPOINTS = {"train": "jobs/train.py", "sweep": "jobs/sweep.py"}
# Never uploaded, on top of .gitignore / .rayignore (Ray reads both): local state that is either big
# (.git, venvs, datasets, runs) or meaningless on the cluster.
DEFAULT_EXCLUDES = [".git", ".venv", "venv", "runs", ".raydl_data", "__pycache__", "*.pyc", ".pytest_cache",
                    "*.egg-info", ".mypy_cache", ".ruff_cache"]
# Local settings the job needs to behave like a local run (RAY_NOTES P5: bf16 SIGILL without the ISA cap).
PASS_THROUGH_ENV = ("OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA")
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
ZIP_ENTRY_OVERHEAD = 128   # bytes per file in Ray's uncompressed (ZIP_STORED) package, headers included


class JobsError(RaydlError):
    """Cannot reach, authenticate with or find something on the Ray job server."""


@dataclass
class Token:
    value: str | None
    source: str          # where it came from, for error messages


def find_token(token_file: str | None = None) -> Token:
    """The token to send, in Ray's own order of precedence, with --token-file first."""
    if token_file:
        return Token(_read_token(Path(token_file).expanduser(), "--token-file"), f"--token-file {token_file}")
    if os.environ.get("RAY_AUTH_TOKEN"):
        return Token(os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN")
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = os.environ["RAY_AUTH_TOKEN_PATH"]
        return Token(_read_token(Path(path).expanduser(), "RAY_AUTH_TOKEN_PATH"), f"RAY_AUTH_TOKEN_PATH={path}")
    default = Path.home() / ".ray" / "auth_token"
    if default.is_file():
        return Token(_read_token(default, "default token file"), str(default))
    return Token(None, "--token-file, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token")


def _read_token(path: Path, what: str) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise JobsError(f"cannot read the auth token file {path} ({what}): {e.strerror}. Fix: point {what} "
                        "at the file that `ray get-auth-token` prints on the head node") from None
    if not token:
        raise JobsError(f"the auth token file {path} ({what}) is empty. Fix: copy the head's token into it "
                        "(`ray get-auth-token` on the head prints it)")
    return token


def resolve_address(address: str | None) -> str:
    """--address, else RAY_API_SERVER_ADDRESS, else an http RAY_ADDRESS, else the local default."""
    for candidate in (address, os.environ.get("RAY_API_SERVER_ADDRESS"), os.environ.get("RAY_ADDRESS")):
        if candidate and (candidate is address or candidate.startswith(("http://", "https://"))):
            return candidate if "://" in candidate else f"http://{candidate}"
    return DEFAULT_ADDRESS


@contextmanager
def _explicit_address() -> Iterator[None]:
    # Ray's client lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override the address argument
    # (dashboard/utils.py::get_address_for_submission_client); raydl's --address must win.
    saved = {k: os.environ.pop(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class Jobs:
    """A JobSubmissionClient whose every call turns Ray's errors into JobsError."""

    def __init__(self, address: str | None = None, token_file: str | None = None):
        self.address = resolve_address(address)
        self.token = find_token(token_file)
        headers = {"Authorization": f"Bearer {self.token.value}"} if self.token.value else None
        with self._errors(), _explicit_address():
            from ray.job_submission import JobSubmissionClient

            self.client = JobSubmissionClient(self.address, headers=headers)

    @contextmanager
    def _errors(self, job_id: str | None = None) -> Iterator[None]:
        import aiohttp
        import requests
        from ray.exceptions import AuthenticationError

        try:
            yield
        except AuthenticationError as e:
            raise JobsError(self._auth_message(str(e))) from None
        # The client raises builtin ConnectionError from its version check, requests' (not a subclass of
        # it) from later calls, and aiohttp's from the log stream.
        except (ConnectionError, requests.exceptions.ConnectionError, aiohttp.ClientConnectionError) as e:
            raise JobsError(f"cannot reach the Ray job server at {self.address} ({type(e).__name__}). Fix: check "
                            "--address (the dashboard port, default 8265, not the GCS port 6379), that the head "
                            "is up, and any SSH tunnel or `kubectl port-forward` to it") from None
        except RuntimeError as e:
            if job_id and "status code 404" in str(e):
                raise JobsError(f"no job '{job_id}' on {self.address}. Fix: `raydl jobs list --address "
                                f"{self.address}` shows the job ids") from None
            if "No available agent" in str(e):
                raise JobsError(f"the Ray head at {self.address} has no job agent running, so it cannot start jobs. "
                                "Fix: wait a minute after `ray start`; if it persists, the head's dashboard agent "
                                "could not start (often a port conflict, see logs/dashboard_agent.log on the head: "
                                "restart with --dashboard-agent-listen-port=<free port>)") from None
            if str(e).startswith("Request failed with status code"):   # the server's own words on a bad request
                raise JobsError(f"the Ray job server at {self.address} refused the request: {e}") from None
            raise

    def _auth_message(self, ray_message: str) -> str:
        if ray_message.startswith("Authentication required"):   # HTTP 401: no token sent
            return (f"the Ray cluster at {self.address} requires an auth token and raydl found none "
                    f"(looked at {self.token.source}). Fix: run `ray get-auth-token` on the head and save it to "
                    "~/.ray/auth_token, or pass --token-file FILE, or set RAY_AUTH_TOKEN")
        return (f"the Ray cluster at {self.address} rejected the auth token from {self.token.source} (HTTP 403). "
                "Fix: use the head's current token (`ray get-auth-token` on the head prints it)")

    def submit(self, entrypoint: str, runtime_env: dict, metadata: dict | None = None,
               agent_wait_s: float = 60) -> str:
        # A head that has just started answers HTTP before its job agent is up ("No available agent to
        # submit job"): that is a matter of seconds, so retry instead of failing.
        deadline = time.monotonic() + agent_wait_s
        with self._errors():
            while True:
                try:
                    return self.client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, metadata=metadata)
                except RuntimeError as e:
                    if "No available agent" not in str(e) or time.monotonic() > deadline:
                        raise
                time.sleep(1)

    def info(self, job_id: str):
        with self._errors(job_id):
            return self.client.get_job_info(job_id)

    def status(self, job_id: str) -> str:
        return str(self.info(job_id).status.value)

    def list(self) -> list:
        with self._errors():
            return self.client.list_jobs()

    def logs(self, job_id: str) -> str:
        with self._errors(job_id):
            return self.client.get_job_logs(job_id)

    def stop(self, job_id: str) -> bool:
        with self._errors(job_id):
            return self.client.stop_job(job_id)

    def wait(self, job_id: str, until: set[str], timeout_s: float | None = None, poll_s: float = 0.5) -> str:
        """Poll until the job's status is in `until` (or the timeout passes); return the last status."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (status := self.status(job_id)) not in until:
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        return status

    def follow(self, job_id: str, out: TextIO = sys.stdout) -> str:
        """Stream the job's logs until it ends; return its final status."""
        self.info(job_id)   # a wrong id fails here with a clear message, not inside the websocket

        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(job_id):
                out.write(chunk)
                out.flush()

        with self._errors(job_id):
            try:
                asyncio.run(tail())
            except RuntimeError as e:   # connection dropped mid-stream: the job may still be running
                print(f"raydl: log stream ended early ({e}); waiting for the job to finish", file=sys.stderr)
        return self.wait(job_id, TERMINAL)


def exit_code(status: str) -> int:
    return 0 if status == "SUCCEEDED" else 1


def entrypoint(command: list[str]) -> str:
    """`raydl submit -- train --config x.yaml` -> `python jobs/train.py --config x.yaml`."""
    if not command or command[0] not in ENTRYPOINTS:
        raise JobsError(f"nothing to submit after '--' (got {shlex.join(command) or 'nothing'}). Fix: "
                        f"`raydl submit ... -- {' | '.join(ENTRYPOINTS)} [--config FILE] [--set k=v ...]`")
    return shlex.join(["python", ENTRYPOINTS[command[0]], *command[1:]])


def check_working_dir(working_dir: Path, command: list[str]) -> None:
    """The job runs `python jobs/<cmd>.py` inside the uploaded copy: what it needs must be in it."""
    if not (working_dir / ENTRYPOINTS[command[0]]).is_file():
        raise JobsError(f"--working-dir {working_dir} has no {ENTRYPOINTS[command[0]]}: the job runs raydl's entry "
                        "point from the uploaded directory. Fix: run from the raydl checkout or pass "
                        "--working-dir path/to/raydl")
    for flag, value in zip(command, command[1:]):
        if flag == "--config" and not _inside(working_dir, value):
            raise JobsError(f"--config {value} is not a file inside --working-dir {working_dir}, so the job "
                            "would not find it. Fix: put the config in the working directory (e.g. jobs/configs/) "
                            "and give its path relative to it")


def _inside(working_dir: Path, path: str) -> bool:
    p = Path(path)
    full = (p if p.is_absolute() else working_dir / p).resolve()
    return full.is_file() and full.is_relative_to(working_dir.resolve())


def package_size(working_dir: Path, excludes: list[str]) -> tuple[int, int]:
    """(bytes, files) of the package Ray would upload: same walk, ignore files and excludes as Ray's zip."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    totals = [0, 0]

    def add(path: Path) -> None:
        if path.is_file():
            totals[0] += path.stat().st_size + ZIP_ENTRY_OVERHEAD + len(str(path))
            totals[1] += 1

    root = working_dir.absolute()
    _dir_travel(root, [_get_excludes(root, excludes)], add, include_gitignore=include_gitignore)
    return totals[0], totals[1]


def check_package_size(working_dir: Path, excludes: list[str]) -> int:
    """Fail before zipping/uploading when the package cannot fit into Ray's GCS store."""
    from ray._private.runtime_env import packaging

    size, files = package_size(working_dir, excludes)
    limit = packaging.GCS_STORAGE_MAX_SIZE
    if size >= limit:
        raise JobsError(f"--working-dir {working_dir} would upload {size / 2**20:.1f} MiB in {files} files, over "
                        f"Ray's limit of {limit / 2**20:.1f} MiB per package. Fix: list big files or folders "
                        "(datasets, checkpoints, outputs) in .rayignore or .gitignore there, or pass --exclude; "
                        "put data on shared storage (s3://, gs://, NFS) and point data.path at it")
    return size


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASS_THROUGH_ENV if k in os.environ}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise JobsError(f"--env {pair!r} is not KEY=VALUE. Fix: e.g. --env OMP_NUM_THREADS=4")
        env[key] = value
    return env


def runtime_env(working_dir: Path, *, env: dict[str, str], excludes: list[str], pip: str | None) -> dict:
    renv = {"working_dir": str(working_dir), "excludes": DEFAULT_EXCLUDES + excludes, "env_vars": env}
    if pip:
        if not Path(pip).is_file():
            raise JobsError(f"--pip {pip} is not a file. Fix: pass a requirements.txt path")
        renv["pip"] = pip   # Ray reads the file here and installs it on every node, cached per env
    return renv
