"""Ctrl-C the sweep driver mid-sweep, then the `raydl sweep --resume` it printed, run as printed: finished trials are
kept, the interrupted one continues; then the report command it printed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from raydl.train import checkpoint as ckpt
from raydl.tune.sweep import TRIALS_DIR, trial_history
from tests.ray.test_stop import printed, user_env

pytestmark = pytest.mark.slow


def wait_for(condition, timeout: float, proc: subprocess.Popen, log: Path):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"sweep exited early ({proc.returncode}):\n{log.read_text()[-3000:]}")
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"timed out:\n{log.read_text()[-3000:]}")


def test_interrupted_sweep_resumes_without_rerunning_finished_trials(ray_session, data_cache, tmp_path):
    sweep = {"base": {"run": {"runs_dir": str(tmp_path / "runs")},
                      "data": {"cache_dir": str(data_cache), "builtin_samples": 4096},
                      "scaling": {"min_workers": 1, "max_workers": 1},
                      "train": {"warmup_steps": 2, "eval_batches": 2, "global_batch_size": 32},
                      "telemetry": {"report_every": 10, "progress": False}, "checkpoint": {"every_steps": 20}},
             # one trial at a time, in this order: short, long (interrupted), short (not started yet)
             "space": {"train.max_steps": [10, 200, 20]}, "objective": "eval_loss", "max_concurrent_trials": 1}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    log = tmp_path / "driver.log"
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from raydl.cli import main; sys.exit(main())",
                             "sweep", "--config", str(tmp_path / "sweep.yaml"), "--address", address],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy())
    runs = tmp_path / "runs"
    trials = lambda: sorted((next(runs.iterdir()) / TRIALS_DIR).iterdir()) if runs.exists() and any(runs.iterdir()) \
        and (next(runs.iterdir()) / TRIALS_DIR).exists() else []
    # Interrupt once the first trial finished and the second saved a checkpoint.
    first, second = wait_for(lambda: trials()[:2] if len(trials()) >= 2 and
                             (trials()[0] / "attempt-1/summary.json").exists() and
                             ckpt.find_latest(trials()[1] / "attempt-1") else None, 240, proc, log)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
    assert "unfinished" in log.read_text()
    assert "Tuner.restore" not in log.read_text() and "Stop signal received" not in log.read_text()   # raydl's alone
    first_metrics = (first / "attempt-1/metrics.jsonl").read_bytes()
    interrupted_at = max(r["step"] for r in trial_history(second))
    assert interrupted_at < 200

    argv = printed(log.read_text(), "raydl sweep --resume")
    assert argv == ["raydl", "sweep", "--resume", str(next(runs.iterdir())), "--address", address], argv
    t0 = time.monotonic()
    resumed = subprocess.run(argv, env=user_env(), capture_output=True, text=True, timeout=600)
    resume_s = time.monotonic() - t0
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((next(runs.iterdir()) / "results.json").read_text())
    rows = {r["trial"]: r for r in summary["trials"]}
    assert [r["status"] for r in rows.values()] == ["ok"] * 3, rows
    # the finished trial was not run again: one attempt, same records
    assert [p.name for p in first.iterdir()] == ["attempt-1"]
    assert (first / "attempt-1/metrics.jsonl").read_bytes() == first_metrics
    # the interrupted one continued from its checkpoint in a second attempt, not from step 1
    second_attempt = (second / "attempt-2/metrics.jsonl").read_text().splitlines()
    first_step = yaml.safe_load(second_attempt[0])["step"]
    assert 1 < first_step <= interrupted_at + 1 and first_step % 20 == 1
    history = trial_history(second)
    assert [r["step"] for r in history] == list(range(1, 201))
    assert rows[second.name]["steps"] == 200 and rows[second.name]["samples"] == 200 * 32
    assert rows[second.name]["attempts"] == 2 and rows[first.name]["attempts"] == 1
    # start times count from the start that led to each trial's latest attempt: the resumed one's from the resume
    assert all(0 < r["start_s"] < r["first_step_after_sweep_s"] for r in rows.values()), rows
    assert rows[second.name]["first_step_after_sweep_s"] < resume_s
    report = subprocess.run(printed(resumed.stderr, "raydl report"), env=user_env(), capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0 and (next(runs.iterdir()) / "report.png").is_file(), report.stderr[-3000:]
