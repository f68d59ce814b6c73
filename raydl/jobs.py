"""Ray Job Submission for raydl: find the cluster and its token, package the checkout, submit, follow.

`raydl submit` and `raydl jobs` are thin CLIs over this module. Everything a user can get wrong
(address, token, job id, working directory) becomes a `JobsError` (exit code 2) that says what was
tried and how to fix it; Ray's own exceptions never reach the user as a traceback.

Token auth (RAY_NOTES 5): a Ray 2.60 client sends the token only when RAY_AUTH_MODE=token is set in
*its* environment, so raydl finds the token itself and always sends it as a Bearer header, but never in
clear text over the network (plain http to a non-loopback host needs --insecure). Every HTTP request has a
timeout (30 s, --http-timeout / RAYDL_HTTP_TIMEOUT_S). The uploaded package leaves out secrets (.env*,
.ray/, keys, token files) and refuses symlinks that point outside the working dir.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import os
import re
import shlex
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, TextIO
from urllib.parse import urlsplit

from raydl.errors import RaydlError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Entry points that plain `ray job submit` can run too; they call the same CLI functions.
ENTRYPOINTS = {"train": "jobs/train.py", "sweep": "jobs/sweep.py"}
# Never uploaded, on top of .gitignore / .rayignore (Ray reads both): local state that is either big
# (.git, venvs, datasets, runs) or meaningless on the cluster.
DEFAULT_EXCLUDES = [".git", ".venv", "venv", "runs", ".raydl_data", "__pycache__", "*.pyc", ".pytest_cache",
                    "*.egg-info", ".mypy_cache", ".ruff_cache"]
# Secrets: anyone who can read the cluster's package store could read them. `*token*.py` is code (raydl's own
# data/tokenizer.py), so it stays; `.env*` comes after it so that a .env_token.py is still left out.
SECRET_EXCLUDES = [".ray", "*token*", "!*token*.py", ".env*", "*.pem", "*.key", ".netrc"]
LEFT_OUT_SHOWN = 5   # names printed in the one-line "left out of the upload" summary
# Local settings the job needs to behave like a local run (RAY_NOTES P5: bf16 SIGILL without the ISA cap).
PASS_THROUGH_ENV = ("OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA")
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# Ray's client waits forever for an answer: a server that accepts and never replies would hang raydl.
HTTP_TIMEOUT_ENV, DEFAULT_HTTP_TIMEOUT_S = "RAYDL_HTTP_TIMEOUT_S", 30.0
_HOSTNAME = re.compile(r"[A-Za-z0-9._-]+")
# Ray's walk logs "Issue with path" when the handler raises; raydl's own error says it all.
_SILENT = logging.getLogger("raydl.jobs.package")
_SILENT.disabled = True
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
    """--address, else RAY_API_SERVER_ADDRESS, else an http RAY_ADDRESS, else the local default; checked."""
    candidates = [("--address", address), *((k, os.environ.get(k)) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"))]
    for source, candidate in candidates:
        if candidate and (source == "--address" or candidate.startswith(("http://", "https://"))):
            return check_address(candidate, source)
    return DEFAULT_ADDRESS


def check_address(given: str, source: str) -> str:
    """The URL to use (http:// when no scheme is given). A malformed address fails here, in words, instead of
    as an InvalidURL traceback from inside Ray."""
    url = given if "://" in given else f"http://{given}"
    problem = _address_problem(url)
    if problem:
        raise JobsError(f"the Ray job server address '{given}' (from {source}) is not a usable URL: {problem}. Fix: "
                        "give the dashboard URL as http://HOST:PORT or https://HOST:PORT, e.g. http://127.0.0.1:8265")
    return url


def _address_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        parts.port   # noqa: B018 -- raises ValueError unless the port is a number in 0..65535
    except ValueError as e:
        return str(e)
    if parts.scheme not in ("http", "https"):
        return f"the scheme is '{parts.scheme}', not http or https"
    host = parts.hostname or ""
    if not (_HOSTNAME.fullmatch(host) or _is_ip(host)):
        return f"'{host}' is not a host name" if host else "it names no host"
    return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)


def check_token_transport(url: str, token: Token, insecure: bool) -> None:
    """The token is the key to the cluster (it runs any code sent with it): never send it in clear text."""
    if token.value is None or insecure or urlsplit(url).scheme == "https" or is_loopback(url):
        return
    raise JobsError(f"refusing to send the Ray auth token (from {token.source}) over plain http to {url}: that "
                    "address is not loopback, so the token would cross the network in clear text, and whoever "
                    "reads it can run any code on the cluster. Fix: use https://, or an SSH tunnel / `kubectl "
                    "port-forward` and --address http://127.0.0.1:8265; pass --insecure only on a network you trust")


def http_timeout(flag: str | float | None) -> float:
    """--http-timeout, else RAYDL_HTTP_TIMEOUT_S, else 30 s: the longest raydl waits for one answer."""
    source, raw = ("--http-timeout", flag) if flag is not None else (HTTP_TIMEOUT_ENV, os.environ.get(HTTP_TIMEOUT_ENV))
    if raw is None or raw == "":
        return DEFAULT_HTTP_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise JobsError(f"{source} is {raw!r}, not a number of seconds > 0. Fix: e.g. {source}"
                        f"{' ' if source.startswith('--') else '='}{DEFAULT_HTTP_TIMEOUT_S:g}")
    return value


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

    def __init__(self, address: str | None = None, token_file: str | None = None, *,
                 timeout_s: str | float | None = None, insecure: bool = False):
        self.address = resolve_address(address)
        self.token = find_token(token_file)
        self.timeout_s = http_timeout(timeout_s)
        check_token_transport(self.address, self.token, insecure)
        headers = {"Authorization": f"Bearer {self.token.value}"} if self.token.value else None
        with self._errors(), _explicit_address():
            self.client = _timed_client(self.address, headers, self.timeout_s)

    @contextmanager
    def _errors(self, job_id: str | None = None) -> Iterator[None]:
        import aiohttp
        import requests
        from ray.exceptions import AuthenticationError

        try:
            yield
        except AuthenticationError as e:
            raise JobsError(self._auth_message(str(e))) from None
        except requests.exceptions.Timeout:   # before ConnectionError: ConnectTimeout is both
            raise JobsError(f"the Ray job server at {self.address} did not answer within {self.timeout_s:g} s. Fix: "
                            "check that --address is the dashboard port (default 8265) of a running Ray head; for a "
                            f"slow server or a large upload raise --http-timeout (or {HTTP_TIMEOUT_ENV})") from None
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


def _timed_client(address: str, headers: dict | None, timeout_s: float):
    """Ray's JobSubmissionClient with a timeout on every HTTP request (it forwards kwargs to requests)."""
    from ray.job_submission import JobSubmissionClient

    class TimedClient(JobSubmissionClient):
        def _do_request(self, method, endpoint, **kwargs):
            return super()._do_request(method, endpoint, timeout=timeout_s, **kwargs)

    return TimedClient(address, headers=headers)


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


@dataclass
class Package:
    """What `raydl submit` uploads: Ray's own walk, ignore files and excludes, as `create_package` zips it."""

    size: int = 0                  # bytes, an upper bound of the zip (ZIP_ENTRY_OVERHEAD per file)
    files: int = 0
    left_out: list[str] = field(default_factory=list)   # top-most paths the excludes and ignore files drop


def scan_package(working_dir: Path, excludes: list[str]) -> Package:
    """Walk the working dir exactly as Ray's zip does; refuse a symlink that would upload something outside it."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    root = working_dir.absolute()
    kept: list[Path] = []
    package = Package()

    def add(path: Path) -> None:
        _refuse_outside_link(path, root)
        kept.append(path)
        if path.is_file():
            package.size += path.stat().st_size + ZIP_ENTRY_OVERHEAD + len(str(path))
            package.files += 1

    _dir_travel(root, [_get_excludes(root, excludes)], add, include_gitignore=include_gitignore, logger=_SILENT)
    kept_set = set(kept)
    dropped = [child for d in kept if d.is_dir() for child in d.iterdir() if child not in kept_set]
    package.left_out = sorted((str(p.relative_to(root)) for p in dropped), key=lambda n: (n.count("/"), n))
    return package


def _refuse_outside_link(path: Path, root: Path) -> None:
    # Ray's zip follows links: a link to ~/.ssh would upload the keys, one to / the whole disk.
    if path.is_symlink() and path.exists() and not path.resolve().is_relative_to(root.resolve()):
        raise JobsError(f"--working-dir {root} holds the symlink {path.relative_to(root)} -> {path.resolve()}, which "
                        "leaves the working dir: Ray would upload what it points to. Fix: remove the link, copy what "
                        "the job needs into the working dir, or --exclude the link")


def check_package(working_dir: Path, excludes: list[str]) -> Package:
    """Fail before zipping/uploading when the package cannot fit into Ray's GCS store or would leak files."""
    from ray._private.runtime_env import packaging

    package = scan_package(working_dir, excludes)
    limit = packaging.GCS_STORAGE_MAX_SIZE
    if package.size >= limit:
        raise JobsError(f"--working-dir {working_dir} would upload {package.size / 2**20:.1f} MiB in {package.files} "
                        f"files, over Ray's limit of {limit / 2**20:.1f} MiB per package. Fix: list big files or "
                        "folders (datasets, checkpoints, outputs) in .rayignore or .gitignore there, or pass "
                        "--exclude; put data on shared storage (s3://, gs://, NFS) and point data.path at it")
    return package


def left_out_summary(package: Package) -> str:
    if not package.left_out:
        return "left out of the upload: nothing"
    names = package.left_out[:LEFT_OUT_SHOWN]
    more = ", ..." if len(package.left_out) > LEFT_OUT_SHOWN else ""
    return (f"left out of the upload: {len(package.left_out)} paths ({', '.join(names)}{more}); "
            "--include PATTERN uploads one anyway")


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASS_THROUGH_ENV if k in os.environ}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise JobsError(f"--env {pair!r} is not KEY=VALUE. Fix: e.g. --env OMP_NUM_THREADS=4")
        env[key] = value
    return env


def runtime_env(working_dir: Path, *, env: dict[str, str], excludes: list[str], pip: str | None,
                includes: list[str] = ()) -> dict:
    """--include re-admits what raydl leaves out by default (a gitignore `!pattern`); --exclude still wins."""
    patterns = DEFAULT_EXCLUDES + SECRET_EXCLUDES + [f"!{p}" for p in includes] + excludes
    renv = {"working_dir": str(working_dir), "excludes": patterns, "env_vars": env}
    if pip:
        if not Path(pip).is_file():
            raise JobsError(f"--pip {pip} is not a file. Fix: pass a requirements.txt path")
        renv["pip"] = pip   # Ray reads the file here and installs it on every node, cached per env
    return renv
