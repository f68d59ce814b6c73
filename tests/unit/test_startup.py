"""Start-up marks: a process's creation time from /proc, and the phases between marks."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from raydl.bench.startup import GOALS_S, report
from raydl.telemetry.startup import ORDER, breakdown, process_start_time


def test_process_start_time_is_when_the_child_was_created():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        after = time.time()
        started = process_start_time(child.pid)
    finally:
        child.kill()
        child.wait()
    # /proc counts in clock ticks (10 ms) and the two clocks are read at different instants.
    assert before - 0.05 <= started <= after + 0.05


def test_breakdown_orders_marks_and_names_each_phase_by_the_mark_that_ends_it():
    marks = {"command_start": 100.0, "first_step": 112.5, "prepared": 102.0, "ray_connected": 107.0,
             "worker_process_start": 109.0}   # some marks missing: a phase runs from the mark before it
    got = breakdown(marks)
    assert list(got["at_s"]) == [m for m in ORDER if m in marks]
    assert got["phase_s"] == {"prepared": 2.0, "ray_connected": 5.0, "worker_process_start": 2.0, "first_step": 3.5}
    assert got["to_first_step_s"] == pytest.approx(12.5)


def test_bench_report_says_whether_the_goal_was_met():
    def stats(*runs):
        return {"median": sorted(runs)[len(runs) // 2], "min": min(runs), "max": max(runs), "spread": 0.1,
                "runs": list(runs)}
    side = {"to_first_step_s": stats(7.0, 7.5, 9.0), "command_wall_s": stats(9.0, 9.5, 11.0),
            "phase:ray_connected": stats(1.0, 2.0, 3.0)}
    assert "goal <= 8 s: met" in report("warm", side) and GOALS_S["warm"] == 8.0
    assert "goal <= 15 s: NOT met" in report("cold", {**side, "to_first_step_s": stats(20.0, 21.0, 22.0)})
    assert "ray_connected" in report("warm", side) and "model_built" not in report("warm", side)
