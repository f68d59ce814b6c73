"""A real `raydl train`'s summary.json records its start-up: every phase, in the order they happen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.telemetry.startup import ORDER


@pytest.mark.slow
def test_summary_has_the_startup_phases_in_order(tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    sets = [*tiny_overrides, "train.max_steps=3", f"run.dir={run_dir}"]
    command = [str(Path(sys.executable).parent / "raydl"), "train", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]

    startup = json.loads((run_dir / "summary.json").read_text())["startup"]
    at = startup["at_s"]
    # every mark, the driver's and the workers', but `compiled`: CPU workers run eager under train.compile=auto
    assert list(at) == [m for m in ORDER if m != "compiled"], at
    assert list(at.values()) == sorted(at.values()), at      # in the order they happen
    assert at["command_start"] == 0 and at["first_step"] == max(at.values()) == startup["to_first_step_s"]
    assert at["prepared"] > 0.1, at   # from the process's creation: the interpreter and imports count
    assert all(seconds >= 0 for seconds in startup["phase_s"].values()), startup
