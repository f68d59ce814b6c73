"""What `raydl train` prints: by default raydl's own lines and at most 3 from Ray, the layout once; with
--quiet only the summary JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_train(tmp_path: Path, data_cache: Path, *flags: str) -> str:
    """stdout and stderr of a 30-step default run, interleaved as a terminal shows them."""
    raydl = str(Path(sys.executable).parent / "raydl")
    sets = ["train.max_steps=30", "telemetry.report_every=10", f"data.cache_dir={data_cache}",
            "data.builtin_samples=4096", "train.eval_batches=2"]
    return subprocess.run([raydl, *flags, "train", *[a for s in sets for a in ("--set", s)]], cwd=tmp_path, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=600).stdout


@pytest.mark.slow
def test_default_run_console_is_quiet(data_cache, tmp_path):
    out = run_train(tmp_path, data_cache)
    lines = out.splitlines()
    raydl_lines = [line for line in lines if "[raydl]" in line]
    summary_lines = lines[lines.index("{"):] if "{" in lines else []
    others = [line for line in lines if line not in raydl_lines and line not in summary_lines]
    assert not any("PlacementGroupCleaner" in line or "PreemptionWatcher" in line for line in lines), out
    assert all(line.startswith("[raydl] ") for line in raydl_lines), raydl_lines   # no Ray prefix, no colour code
    assert sum("2 workers: data-parallel × 2 (DDP: " in line and ", from step 0, " in line for line in lines) == 1, out
    assert sum("[raydl] step " in line for line in lines) == 3 and summary_lines, out
    assert len(others) <= 3, "\n".join(others)   # whole lines: pytest cuts a list's repr


@pytest.mark.slow
def test_quiet_run_prints_only_the_summary(data_cache, tmp_path):
    out = run_train(tmp_path, data_cache, "--quiet")
    assert not [line for line in out.splitlines() if "[raydl]" in line], out
    lines = out.splitlines()
    assert "{" in lines, out
    summary = json.loads("\n".join(lines[lines.index("{"):]))
    assert summary["steps"] == 30 and lines.index("{") <= 3, out   # Ray's own lines, at most 3, come before it
