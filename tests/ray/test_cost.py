"""Cost per run through a real `raydl train` on the session's Ray: summary.json's device-hours and $ equal the hand
computation from the run's own metrics.jsonl and cluster/prices.yaml, with a worker failure and restart in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from raydl.driver.ray_trainer import run_training
from raydl.overrides import load_config
from raydl.telemetry.cost import TABLE_PATH

CPUS_PER_WORKER = 2


def elapsed(line: dict) -> float:
    """A step's own time and the time before it (eval, report, checkpoint): what the meter charges."""
    return line["between_s"] + line["step_s"]


def core_seconds(lines: list[dict], restart: dict) -> float:
    """Each step at its world size x cores per worker x its elapsed time; the restart's gap at the smaller world
    size."""
    seconds = sum(elapsed(line) * line["world_size"] for line in lines)
    after = next(i for i, line in enumerate(lines) if line["step"] == restart["resumed_at_step"] + 1 and i)
    before, first = lines[after - 1], lines[after]
    gap = first["time"] - elapsed(first) - before["time"]
    return CPUS_PER_WORKER * (seconds + gap * min(before["world_size"], first["world_size"]))


@pytest.mark.slow
def test_summary_cost_is_the_records_priced_from_the_table(ray_session, data_cache, tmp_path):
    sets = [f"data.cache_dir={data_cache}", f"run.runs_dir={tmp_path / 'runs'}", "train.max_steps=30",
            "telemetry.report_every=5", "checkpoint.every_steps=10", "data.builtin_samples=4096",
            "train.eval_batches=2", "telemetry.progress=false", f"scaling.cpus_per_worker={CPUS_PER_WORKER}",
            "scaling.min_workers=1", "scaling.max_workers=2", f"debug.ledger_dir={tmp_path / 'ledger'}",
            "debug.fail_at_step=15", "cost.instance_type=m5.2xlarge",   # a CPU run is priced on a named machine
            "scaling.survivors=off"]   # a restart of the whole group, priced in its own row
    (tmp_path / "ledger").mkdir()
    summary = run_training(load_config(None, sets))
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]

    assert summary["steps"] == 30 and len(summary["restarts"]) == 1, summary["restarts"]
    table = yaml.safe_load(TABLE_PATH.read_text())
    machine = table["machines"]["m5.2xlarge"]
    hours = core_seconds(lines, summary["restarts"][0]) / 3600
    assert summary["device_hours"] == pytest.approx(hours, rel=1e-9)
    assert summary["cost_usd"] == pytest.approx(hours * machine["on_demand"] / machine["vcpus"], rel=1e-9)
    assert lines[-1]["cost_usd"] == pytest.approx(summary["cost_usd"], rel=1e-9)
    assert summary["pricing"]["unit"] == "CPU core" and summary["pricing"]["units_per_worker"] == CPUS_PER_WORKER
