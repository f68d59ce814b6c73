"""What a default `raydl train` prints: raydl's own lines and at most 3 from Ray, the layout once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_default_run_console_is_quiet(data_cache, tmp_path):
    raydl = str(Path(sys.executable).parent / "raydl")
    sets = ["train.max_steps=30", "telemetry.report_every=10", f"data.cache_dir={data_cache}",
            "data.builtin_samples=4096", "train.eval_batches=2"]
    out = subprocess.run([raydl, "train", *[a for s in sets for a in ("--set", s)]], cwd=tmp_path, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=600).stdout
    lines = out.splitlines()
    raydl_lines = [line for line in lines if "[raydl]" in line]
    summary_lines = lines[lines.index("{"):] if "{" in lines else []
    others = [line for line in lines if line not in raydl_lines and line not in summary_lines]
    assert not any("PlacementGroupCleaner" in line or "PreemptionWatcher" in line for line in lines), out
    assert sum("layout {" in line for line in lines) == 1, out
    assert sum("[raydl] step " in line for line in lines) == 3 and summary_lines, out
    assert len(others) <= 3, others
