"""Ctrl-C / SIGTERM: the run checkpoints at its next report, prints how to resume and exits 128 + signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.bench.fault_cluster import poll

pytestmark = pytest.mark.slow


def first_record_written(run_root: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    poll(f"a step record under {run_root}",
         lambda: proc.poll() is not None or any(p.stat().st_size for p in run_root.rglob("metrics.jsonl")),
         timeout_s)
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before its first record"


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


SETS = ["train.max_steps=100000", "telemetry.report_every=5", "checkpoint.every_steps=100000",
        "data.builtin_samples=4096", "train.eval_batches=2", "telemetry.progress=false"]


@pytest.mark.parametrize("launcher, sig", [("ray", signal.SIGINT), ("torchrun", signal.SIGTERM)])
def test_first_signal_checkpoints_and_says_how_to_resume(launcher, sig, data_cache, tmp_path):
    sets = [*SETS, f"data.cache_dir={data_cache}", "scaling.min_workers=1", "scaling.max_workers=1"]
    args = [a for s in sets for a in ("--set", s)]
    argv = ([str(Path(sys.executable).parent / "raydl"), "train", *args] if launcher == "ray"
            else [sys.executable, "-m", "raydl.worker", *args, "--run-dir", str(tmp_path / "runs" / "tr")])
    proc = start(argv, tmp_path)
    first_record_written(tmp_path / "runs", proc, timeout_s=180)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 128 + sig, out[-3000:]
    summary = json.loads(next((tmp_path / "runs").rglob("summary.json")).read_text())
    assert summary["stopped_by_signal"] == sig and 0 < summary["steps"] < 100000
    assert summary["checkpoint"] and Path(summary["checkpoint"]).name == f"step_{summary['steps']:08d}"
    # Lines forwarded from Ray's own actors carry "(Name pid=N)"; Ray's shutdown noise is not raydl's output.
    own = [line for line in out.splitlines() if "pid=" not in line]
    assert any("resume" in line for line in own) and not any("Traceback" in line for line in own), out[-3000:]
