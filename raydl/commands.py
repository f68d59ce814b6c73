"""Every command raydl prints for the user to run, built here and only here.

Each is a shell line that works when pasted as it is (paths quoted by `shlex.join`), and each is run verbatim by
a test that reads it off the console: resume after Ctrl-C and SIGTERM (tests/ray/test_stop.py), after a lost
cluster (tests/ray/test_late_start.py), a sweep's resume (tests/ray/test_sweep_resume.py), a job's logs
(tests/ray/test_jobs_submit.py). A command names only what is still true when it is read: the --address of the
cluster a run or sweep used while that cluster is there, never a lost one's (a local Ray, or the address of the
cluster once it is back, runs it).
"""

from __future__ import annotations

import os
import shlex

PROGRAM = "raydl"


def command(*words: str | os.PathLike) -> str:
    return shlex.join([PROGRAM, *map(str, words)])


def resume_run(run_dir: str | os.PathLike, address: str | None = None) -> str:
    """Continue a run from its newest checkpoint, with its own config (raydl.driver.resume), on the cluster at
    `address` (a cluster still there; None: a local Ray)."""
    return command("train", "--resume", run_dir, *on(address))


def resume_sweep(sweep_dir: str | os.PathLike, address: str | None = None) -> str:
    return command("sweep", "--resume", sweep_dir, *on(address))


def on(address: str | None) -> list[str]:
    return ["--address", address] if address else []


def train_with(config_file: str | os.PathLike) -> str:
    return command("train", "--config", config_file)


def report(source: str | os.PathLike) -> str:
    return command("report", source)


def job_logs(job_id: str, connection: list[str]) -> str:
    """`connection`: the --address/--token-file/... arguments the submission itself used (`connection_args`)."""
    return command("jobs", "logs", job_id, "--follow", *connection)


def jobs_list(connection: list[str]) -> str:
    return command("jobs", "list", *connection)


def connection_args(address: str, token_file: str | None = None, http_timeout: str | float | None = None,
                    insecure: bool = False) -> list[str]:
    """The job server's connection as arguments of `raydl jobs` (the address as the client resolved it)."""
    return ["--address", address, *(["--token-file", os.path.abspath(token_file)] if token_file else []),
            *(["--http-timeout", str(http_timeout)] if http_timeout else []), *(["--insecure"] if insecure else [])]
