"""raydl submit / raydl jobs against a real Ray job server (token auth on, loopback only).

One head for the module (`ray start --head --block`, stopped by pid). Jobs upload this checkout and run
`python jobs/train.py` in it, exactly like a user's submission to a remote cluster.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from raydl import jobs
from raydl.cli import main
from tests.ray.ray_head import VENV_BIN, short_tmp_dir, start_head, stop_head
from tests.ray.test_stop import printed
from tests.ray.test_worker_tracebacks import assert_paragraph_and_log

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FAST = ["--set", "train.max_steps=20", "--set", "data.builtin_samples=4096", "--set", "scaling.max_workers=1",
        "--set", "scaling.min_workers=1", "--set", "telemetry.progress=false"]
ENTRY_LINE = re.compile(r"\[raydl\] job entry: raydl train from \S+/_ray_pkg_\w+/raydl")


@pytest.fixture(scope="module")
def head():
    h = start_head(short_tmp_dir(), num_cpus=2)
    yield h
    stop_head(h)


def raydl(head, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """The installed `raydl` CLI in a subprocess, as a user runs it (cwd = the checkout); the token comes
    from --token-file only (see conn), so these calls show that raydl sends it by itself."""
    return subprocess.run([f"{VENV_BIN}/raydl", *args], cwd=REPO, env=head.client_env(token_env=False),
                          capture_output=True, text=True, timeout=timeout)


def conn(head) -> list[str]:
    return ["--address", head.address, "--token-file", str(head.token_file)]


def test_raydl_submit_trains_and_jobs_cli_follows(head):
    t0 = time.monotonic()
    sub = raydl(head, "submit", *conn(head), "--", "train", *FAST)
    running_s = time.monotonic() - t0
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip()
    assert job_id.startswith("raysubmit_") and re.search(rf"job {job_id} (RUNNING|SUCCEEDED) after", sub.stderr)
    printed_logs = printed(sub.stderr, "raydl jobs logs")   # the command `raydl submit` printed, run as printed
    assert printed_logs == ["raydl", "jobs", "logs", job_id, "--follow", *conn(head)], printed_logs
    logs = raydl(head, *printed_logs[1:])
    total_s = time.monotonic() - t0
    assert logs.returncode == 0, logs.stderr[-3000:]
    assert f"job {job_id} SUCCEEDED" in logs.stderr
    # The job ran the uploaded copy of raydl (not this checkout's editable install) on the head's cluster.
    assert ENTRY_LINE.search(logs.stdout), logs.stdout[:2000]
    assert '"steps": 20' in logs.stdout and '"world_sizes": [\n  1\n ]' in logs.stdout
    status = raydl(head, "jobs", "status", job_id, *conn(head))
    assert status.returncode == 0 and f"{job_id}: SUCCEEDED" in status.stdout
    listing = raydl(head, "jobs", "list", *conn(head))
    assert re.search(rf"{job_id}\s+SUCCEEDED .* python jobs/train.py --set train.max_steps=20", listing.stdout)
    print(f"\n[timing] raydl submit -> RUNNING {running_s:.1f} s, -> SUCCEEDED {total_s:.1f} s")


def test_plain_ray_job_submit_trains(head):
    t0 = time.monotonic()
    out = subprocess.run([f"{VENV_BIN}/ray", "job", "submit", "--address", head.address, "--working-dir", ".", "--",
                          "python", "jobs/train.py", *FAST], cwd=REPO, env=head.client_env(token_env=True),
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout + out.stderr
    assert "succeeded" in text and ENTRY_LINE.search(text) and '"steps": 20' in text
    print(f"\n[timing] plain ray job submit -> SUCCEEDED {time.monotonic() - t0:.1f} s")


def test_a_job_whose_workers_raise_raydls_error_logs_the_paragraph_not_tracebacks(head):
    """The job's logs (its `raydl train`'s console) hold raydl's paragraph and no worker traceback; the workers.log it
    names holds the traceback of each of its two workers, and `raydl train` exited 1. (The same failure of a
    `raydl train` started from a shell: the same console, checked here.)"""
    two_workers = ["--set", "scaling.min_workers=2", "--set", "scaling.max_workers=2",
                   "--set", "scaling.cpus_per_worker=0.5"]   # the head's 2 CPUs
    sub = raydl(head, "submit", *conn(head), "--follow", "--", "train", *FAST, *two_workers, "--set", "train.lr=1e30")
    job_id = sub.stdout.splitlines()[0]
    assert sub.returncode == 1 and f"job {job_id} FAILED" in sub.stderr, sub.stderr[-3000:]
    workers_log = assert_paragraph_and_log(sub.stdout, "training diverged at step", ranks=2)
    assert "raise TrainingDivergedError" in workers_log.read_text()   # the head is this machine
    message = jobs.Jobs(head.address, str(head.token_file)).info(job_id).message
    assert "failed with exit code 1" in message, message


def test_stop_a_running_job(head):
    sub = raydl(head, "submit", *conn(head), "--no-wait", "--", "train", *FAST, "--set", "train.max_steps=100000")
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip()
    client = jobs.Jobs(head.address, str(head.token_file))
    assert client.wait(job_id, {"RUNNING"} | jobs.TERMINAL, timeout_s=60) == "RUNNING"
    stop = raydl(head, "jobs", "stop", job_id, *conn(head))
    assert stop.returncode == 0 and f"job {job_id} STOPPED" in stop.stderr, stop.stderr
    status = raydl(head, "jobs", "status", job_id, *conn(head))
    assert status.returncode == 1 and "STOPPED" in status.stdout


@pytest.fixture
def no_local_token(monkeypatch, tmp_path):
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))   # no ~/.ray/auth_token either


def test_missing_token_exit_2(head, tmp_path):
    # A fresh process, as a user runs it: an in-process ray.init (another test's) leaves Ray's
    # process-wide token cache set, and Ray's client would send that token by itself.
    env = {**head.client_env(token_env=False), "HOME": str(tmp_path)}   # no ~/.ray/auth_token either
    r = subprocess.run([f"{VENV_BIN}/raydl", "submit", "--address", head.address, "--working-dir", str(REPO),
                        "--", "train"], cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 2, r.stderr
    assert f"the Ray cluster at {head.address} requires an auth token and raydl found none" in r.stderr
    assert "ray get-auth-token" in r.stderr and "Traceback" not in r.stderr


def test_wrong_token_exit_2(head, no_local_token, monkeypatch, tmp_path, capsys):
    bad = tmp_path / "bad_token"
    bad.write_text("not-the-token\n")
    assert main(["jobs", "list", "--address", head.address, "--token-file", str(bad)]) == 2
    assert f"rejected the auth token from --token-file {bad} (HTTP 403)" in capsys.readouterr().err
    monkeypatch.setenv("RAY_AUTH_TOKEN", "also-wrong")
    assert main(["jobs", "status", "raysubmit_x", "--address", head.address]) == 2
    assert "rejected the auth token from RAY_AUTH_TOKEN" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["status", "logs", "stop"])
def test_unknown_job_id_exit_2(head, no_local_token, capsys, action):
    assert main(["jobs", action, "raysubmit_doesnotexist", *conn(head)]) == 2
    err = capsys.readouterr().err
    assert f"no job 'raysubmit_doesnotexist' on {head.address}" in err
    listing = printed(err, "raydl jobs list")   # the command the error suggests lists the jobs, as printed
    assert listing == ["raydl", "jobs", "list", *conn(head)], listing
    assert main(listing[1:]) == 0 and capsys.readouterr().out.startswith("ID")


def test_token_sent_even_with_auth_mode_env_on(head, no_local_token, monkeypatch, capsys):
    # RAY_AUTH_MODE=token makes Ray's client add its own header; raydl's must not clash with it.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", head.token)
    assert main(["jobs", "list", "--address", head.address]) == 0
    assert capsys.readouterr().out.startswith("ID")
