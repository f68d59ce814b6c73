"""Profiling real steps: torchrun at dp=2 and at pp=2 (gloo), and `raydl profile` on Ray; the traces are read back.

The breakdown's parts, taken from each rank's trace, must add up to the step time the loop measured
with its own clock, within 10%; which parts appear is fixed by the layout (no test asserts a time).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raydl.cli import main
from raydl.telemetry.profile_breakdown import PARTS, STEP_RANGE
from raydl.telemetry.profiler import WARMUP_STEPS
from tests.helpers import torchrun_worker

PROFILED = 3


def overrides(tiny_overrides: list[str], steps: int) -> list[str]:
    kept = [o for o in tiny_overrides if not o.startswith("train.max_steps")]
    return [*kept, f"train.max_steps={WARMUP_STEPS + steps}", f"telemetry.profile_steps={steps}"]


def read_profile(profile_dir: Path, ranks: int, steps: int) -> dict:
    """breakdown.json after checking every rank's trace: Chrome trace JSON with one raydl.step range per step."""
    for rank in range(ranks):
        trace = json.loads((profile_dir / f"rank{rank}.json").read_text())
        names = [e.get("name") for e in trace["traceEvents"]]
        assert names.count(STEP_RANGE) == steps and "aten::mm" in names
    breakdown = json.loads((profile_dir / "breakdown.json").read_text())
    assert breakdown["steps"] == [WARMUP_STEPS + 1, WARMUP_STEPS + steps]
    assert [r["rank"] for r in breakdown["ranks"]] == list(range(ranks))
    for r in breakdown["ranks"]:
        assert set(r["parts"]) == set(PARTS) and min(r["parts"].values()) >= 0
        assert sum(r["parts"].values()) == pytest.approx(r["step_s"], rel=0.10), r
        assert r["parts"]["forward"] > 0 and r["parts"]["backward"] > 0 and r["parts"]["optimizer"] > 0
        assert r["top_ops"] and r["top_ops"][0]["self_s"] > 0
    return breakdown


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_parallel_profile_under_torchrun(tiny_overrides, tmp_path):
    done = torchrun_worker(2, tmp_path / "run", overrides(tiny_overrides, PROFILED), timeout_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    breakdown = read_profile(tmp_path / "run" / "profile", 2, PROFILED)
    assert breakdown["layout"]["dp"] == 2
    for r in breakdown["ranks"]:
        assert r["parts"]["collective"] > 0          # the gradient all-reduce
        assert r["parts"]["send_recv"] == 0 and r["parts"]["bubble"] == 0
    assert "top ops by self time" in done.stdout and "data wait" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_profile_under_torchrun_shows_send_recv_and_bubble(tiny_overrides, tmp_path):
    pp2 = ["parallel.pp_degree=2", "parallel.schedule=1f1b", "parallel.num_microbatches=4"]
    done = torchrun_worker(2, tmp_path / "run", overrides(tiny_overrides, PROFILED) + pp2, timeout_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    breakdown = read_profile(tmp_path / "run" / "profile", 2, PROFILED)
    assert [(r["dp_rank"], r["pp_rank"]) for r in breakdown["ranks"]] == [(0, 0), (0, 1)]
    assert all(r["parts"]["send_recv"] > 0 for r in breakdown["ranks"])
    # the last stage waits for the first one's forward at least once per step
    assert breakdown["ranks"][1]["parts"]["bubble"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_raydl_profile_on_ray(tiny_overrides, ray_session, capsys, tmp_path):
    """docs/seeing-inside.md's block as printed there (which marks it `tested by` this test), with the test's data
    cache and short evaluations: `raydl profile --steps 2 --set telemetry.tensorboard=true --set run.dir=...`, its
    breakdown, `raydl report` of the run, the files the page lists, and the page's `raydl plan --cluster ...`."""
    run_dir = tmp_path / "runs" / "profiled"
    argv = ["profile", "--steps", "2", "--set", "telemetry.tensorboard=true", "--set", f"run.dir={run_dir}",
            *(a for o in tiny_overrides for a in ("--set", o))]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["profiled"]
    assert f"{run_dir / 'profile' / 'breakdown.json'}" in out
    read_profile(run_dir / "profile", 2, 2)
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.png").is_file() and (run_dir / "tensorboard").is_dir()
    assert (run_dir / "profile" / "rank0.json").is_file()
    repo = Path(__file__).resolve().parents[2]
    assert main(["plan", "--cluster", str(repo / "cluster" / "aws-gpu.yaml"), "--steps", "20000", "--deadline", "12",
                 "--budget", "100"]) == 0
