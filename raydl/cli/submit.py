"""raydl submit: run `raydl train|sweep ...` as a Ray job on a cluster (Ray Job Submission API).

    raydl submit --address http://HEAD:8265 [--token-file F] [--working-dir .] [--env K=V] [--pip req.txt]
                 [--include PATTERN] [--follow | --no-wait]
                 -- train --config jobs/configs/gpt-small.yaml [--set k=v ...]

The working directory (the raydl checkout) is zipped and uploaded; the job runs `python jobs/train.py ...`
in it, so code and configs on the cluster are exactly what you have locally. Secrets never go with it:
.env*, .ray/ (Ray's auth token), *.pem, *.key, .netrc and *token* files (not *token*.py code) are left out,
as are .gitignore/.rayignore entries; one line on stderr says what was left out. A symlink that leads out
of the working dir is an error. Prints the job id on stdout.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from raydl import commands, job_package, jobs

log = logging.getLogger(__name__)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="Ray job server (dashboard) URL, e.g. http://127.0.0.1:8265; default: "
                   f"RAY_API_SERVER_ADDRESS, an http RAY_ADDRESS, else {jobs.DEFAULT_ADDRESS}.")
    p.add_argument("--token-file", help="File holding the cluster's auth token; default: RAY_AUTH_TOKEN, "
                   "RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token.")
    p.add_argument("--http-timeout", metavar="SECONDS", help="Longest wait for the job server to answer one "
                   f"request; default: {jobs.HTTP_TIMEOUT_ENV}, else {jobs.DEFAULT_HTTP_TIMEOUT_S:g}.")
    p.add_argument("--insecure", action="store_true", help="Send the auth token over plain http to a non-loopback "
                   "address (in clear text on the network); without it raydl refuses.")


def connect(args) -> jobs.Jobs:
    return jobs.Jobs(args.address, args.token_file, timeout_s=args.http_timeout, insecure=args.insecure)


def register(sub) -> None:
    p = sub.add_parser("submit", help="Submit a raydl train/sweep run to a Ray cluster as a Ray job.",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_args(p)
    p.add_argument("--working-dir", default=".", help="Directory to upload (the raydl checkout); .gitignore, "
                   ".rayignore and --exclude apply, and runs/, .venv/, .git/, .raydl_data/ and secrets are left out.")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="Extra gitignore-style pattern not to upload; repeatable.")
    p.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="Upload paths matching this gitignore-style pattern although raydl leaves them out by "
                   "default (name the left-out path itself, e.g. .env.example); repeatable. .gitignore and "
                   ".rayignore entries and --exclude still apply.")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="Env var for the job and its workers; repeatable. OMP_NUM_THREADS and ONEDNN_MAX_CPU_ISA "
                   "are passed through when set here.")
    p.add_argument("--pip", metavar="REQUIREMENTS", help="requirements.txt to install on the cluster for this job.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", help="Stream the job's logs until it ends; exit 0 if it "
                      "SUCCEEDED, 1 if it FAILED or was STOPPED.")
    mode.add_argument("--no-wait", action="store_true", help="Return right after submission (default: wait until "
                      "the job has started running, so that setup failures show up here).")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- train|sweep [args of that raydl command]")
    p.set_defaults(func=run)


def run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    entry = job_package.entrypoint(command)
    working_dir = Path(args.working_dir).resolve()
    job_package.check_working_dir(working_dir, command)
    renv = job_package.runtime_env(working_dir, env=job_package.parse_env(args.env), excludes=args.exclude, pip=args.pip,
                            includes=args.include)
    package = job_package.check_package(working_dir, renv["excludes"])
    job_package.check_model_uploaded(working_dir, command, package)
    say(job_package.left_out_summary(package))
    client = connect(args)
    t0 = time.monotonic()
    job_id = client.submit(entry, renv, metadata={"raydl_command": command[0]})
    say(f"submitted {job_id} to {client.address} ({package.size / 2**20:.1f} MiB uploaded in "
        f"{time.monotonic() - t0:.1f} s): {entry}")
    print(job_id, flush=True)
    if args.no_wait:
        return 0
    if args.follow:
        status = client.follow(job_id)
        say(f"job {job_id} {status}")
        return jobs.exit_code(status)
    status = client.wait(job_id, {"RUNNING"} | jobs.TERMINAL)
    say(f"job {job_id} {status} after {time.monotonic() - t0:.1f} s; logs: {commands.job_logs(job_id, client.connection)}")
    return jobs.exit_code(status) if status in {"FAILED", "STOPPED"} else 0


def say(message: str) -> None:
    """Human-readable progress goes to stderr; stdout carries only the job id (for scripts)."""
    log.info(message)
