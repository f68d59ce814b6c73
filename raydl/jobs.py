"""Ray Job Submission for raydl: find the cluster and its token, package the checkout, submit, follow.

`raydl submit` and `raydl jobs` are thin CLIs over this module. Everything a user can get wrong
(address, token, job id, working directory) becomes a `JobsError` (exit code 2) that says what was
tried and how to fix it; Ray's own exceptions never reach the user as a traceback.

Token auth: a Ray 2.60 client sends the token only when RAY_AUTH_MODE=token is set in
*its* environment, so raydl finds the token itself and always sends it as a Bearer header, but never in
clear text over the network (plain http to a non-loopback host needs --insecure). Every HTTP request has a
timeout (30 s, --http-timeout / RAYDL_HTTP_TIMEOUT_S). What a job uploads and runs: `raydl.job_package`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO
from urllib.parse import urlsplit

from raydl import commands
from raydl.errors import RaydlError

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# Ray's client waits forever for an answer: a server that accepts and never replies would hang raydl.
HTTP_TIMEOUT_ENV, DEFAULT_HTTP_TIMEOUT_S = "RAYDL_HTTP_TIMEOUT_S", 30.0
_HOSTNAME = re.compile(r"[A-Za-z0-9._-]+")


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
        self.connection = commands.connection_args(self.address, token_file, timeout_s, insecure)   # for the commands it prints
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
                raise JobsError(f"no job '{job_id}' on {self.address}. Fix: `{commands.jobs_list(self.connection)}` "
                                "shows the job ids") from None
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
                log.warning(f"log stream ended early ({e}); waiting for the job to finish")
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
