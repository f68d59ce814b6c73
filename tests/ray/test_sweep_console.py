"""What a `raydl sweep` prints: raydl's own lines, the report table and at most 3 lines from Ray; no Train
placement-group noise, no Tune NaN warnings, no Tune tables; every trial's start time in the report. The sweep is
docs/sweeps.md's first command, `raydl sweep --config examples/sweep_tiny.yaml` (2 one-worker trials of 20 steps of the
default tiny GPT), which marks it `tested by` this test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


REPO = Path(__file__).resolve().parents[2]
SWEEP_TINY = REPO / "examples" / "sweep_tiny.yaml"


def report_table(lines: list[str]) -> list[str]:
    """The printed report: from its header line to the median start line."""
    first = next(i for i, line in enumerate(lines) if line.startswith("trial ") and "start s" in line)
    last = next(i for i, line in enumerate(lines) if line.startswith("median trial start"))
    return lines[first:last + 1]


def test_sweep_console_is_quiet_and_reports_each_trials_start(data_cache, tmp_path, on_shared_ray):
    raydl = str(Path(sys.executable).parent / "raydl")
    sets = [f"data.cache_dir={data_cache}", "data.builtin_samples=4096", "train.eval_batches=2"]   # the test's data
    out = subprocess.run([raydl, "sweep", "--config", str(SWEEP_TINY), *(a for s in sets for a in ("--set", s))],
                         cwd=tmp_path, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=600).stdout
    lines = out.splitlines()
    table = report_table(lines)
    others = [line for line in lines if "[raydl]" not in line and line not in table and line.strip()]
    assert not any("PlacementGroupCleaner" in line or "NaN or Inf" in line for line in lines), out
    assert not any("Configuration for experiment" in line or "Trial status" in line for line in lines), out
    assert not any("RayTrainWorker" in line for line in lines), out   # 1-worker trials train in their own process
    assert len(others) <= 3, "\n".join(others)   # whole lines: pytest cuts a list's repr

    results = json.loads(next((tmp_path / "runs").glob("*/results.json")).read_text())
    assert [t["status"] for t in results["trials"]] == ["ok", "ok"], results["trials"]
    for trial in results["trials"]:
        assert 0 < trial["start_s"] < trial["first_step_after_sweep_s"], trial
        row = next(line for line in table if line.lstrip("* ").startswith(trial["trial"]))
        assert f"{trial['start_s']:.3g}" in row.split(), row
    starts = sorted(t["start_s"] for t in results["trials"])
    assert results["median_start_s"] == pytest.approx(sum(starts) / 2)
    assert f"{results['median_start_s']:.1f} s" in table[-1]
