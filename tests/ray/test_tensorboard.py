"""telemetry.tensorboard and `raydl report` after real `raydl train` and `raydl sweep` runs on the test Ray:
the event files read back with TensorBoard's reader, the report's table against summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raydl.cli import main
from raydl.tune.space import parse_sweep
from raydl.tune.sweep import run_sweep
from tests.unit.test_report import assert_png, table_rows
from tests.unit.test_tensorboard import assert_events_match_metrics, read_events, texts

pytestmark = pytest.mark.slow

# Every section the default model on CPU reports into (no GPU readings here).
CPU_TAGS = {"loss/loss", "loss/eval_loss", "optimizer/lr", "optimizer/grad_norm", "throughput/samples_per_s",
            "throughput/tokens_per_s", "time/step_s", "time/data_wait_frac", "memory/peak_memory_mb", "run/world_size"}


def test_raydl_train_writes_every_metric_and_the_restart_as_events(ray_session, tiny_overrides, tmp_path, capsys):
    # Reports every 2 steps and a failure at step 15: steps 11-14 are reported, then redone from the step-10 checkpoint.
    (tmp_path / "ledger").mkdir()   # where the injected failure marks that it happened (it fires once)
    sets = [*tiny_overrides, "telemetry.tensorboard=true", "telemetry.report_every=2", "train.eval_every=10",
            f"debug.ledger_dir={tmp_path / 'ledger'}", "debug.fail_at_step=15",
            "checkpoint.memory_every_steps=0"]   # the restart redoes steps from the step-10 storage checkpoint
    assert main(["train", *(arg for s in sets for arg in ("--set", s))]) == 0
    [run_dir] = (tmp_path / "runs").iterdir()
    capsys.readouterr()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and len(summary["restarts"]) == 1

    tags = assert_events_match_metrics(run_dir, run_dir / "tensorboard")
    assert CPU_TAGS <= tags
    events = read_events(run_dir / "tensorboard")
    [(step, restart)] = texts(events, "events/restarts").items()
    assert step == 11 and "injected failure at step 15" in restart and "resumed at step 10" in restart
    assert texts(events, "events/layouts")[1].startswith("2 workers from step 1: dp 2 x pp 1")

    assert main(["report", str(run_dir)]) == 0
    table = dict(table_rows(capsys.readouterr().out)[1:])
    assert int(table["steps"]) == 20 and int(table["restarts"]) == 1
    assert float(table["final loss"]) == pytest.approx(summary["final_loss"], rel=1e-3)
    assert_png(run_dir / "report.png")


def test_a_sweep_writes_a_tensorboard_directory_per_trial(ray_session, data_cache, tmp_path, capsys):
    base = {"run": {"runs_dir": str(tmp_path / "runs")}, "data": {"cache_dir": str(data_cache), "builtin_samples": 4096},
            "scaling": {"min_workers": 1, "max_workers": 1}, "train": {"max_steps": 10, "eval_batches": 2},
            "telemetry": {"report_every": 5, "progress": False, "tensorboard": True}, "checkpoint": {"every_steps": 10}}
    result = run_sweep(parse_sweep({"base": base, "space": {"train.lr": [1e-3, 3e-3]}, "objective": "eval_loss"}))
    sweep_dir = Path(result["sweep_dir"])
    capsys.readouterr()

    trials = [row["trial"] for row in result["trials"]]
    assert sorted(p.name for p in (sweep_dir / "tensorboard").iterdir()) == sorted(trials)
    for row in result["trials"]:
        assert_events_match_metrics(Path(row["run_dir"]), sweep_dir / "tensorboard" / row["trial"])

    assert main(["report", str(sweep_dir)]) == 0
    header, *lines = table_rows(capsys.readouterr().out)
    assert len(lines) == len(trials) and all(int(dict(zip(header, line))["steps"]) == 10 for line in lines)
    assert_png(sweep_dir / "report.png")
