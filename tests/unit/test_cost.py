"""Cost per run: the writer's device-hours and $ against a hand computation from cluster/prices.yaml, read here
with plain YAML; resizes, restarts and a restart in place (torchrun) included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from raydl.metrics.writer import MetricsWriter
from raydl.driver.prepare import prepare_run
from raydl.errors import ConfigError
from raydl.overrides import dump_yaml, load_config
from raydl.telemetry.cost import TABLE_PATH, Pricing, format_hours, format_usd
from raydl.telemetry.records import FinalInfo, StepRecord, WorkerReport

TABLE = yaml.safe_load(TABLE_PATH.read_text())
MACHINES = TABLE["machines"]
START = 1.8e9


def step(n: int, world_size: int, time: float, step_s: float) -> StepRecord:
    return StepRecord(step=n, epoch=0, loss=1.0, lr=1e-3, grad_norm=1.0, samples=64, world_size=world_size, time=time,
                      step_s=step_s, data_wait_s=0.0, data_wait_frac=0.0, samples_per_s=64 / step_s,
                      tokens_per_s=64 / step_s, bad_shards=0, peak_memory_mb=100.0)


def group(first: int, last: int, world_size: int, start: float, step_s: float) -> list[StepRecord]:
    """Steps first..last of one worker group, the first ending step_s after `start`."""
    return [step(n, world_size, start + (i + 1) * step_s, step_s) for i, n in enumerate(range(first, last + 1))]


def run_dir_with(tmp_path: Path, overrides: list[str]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_yaml(load_config(None, overrides)))
    return run_dir


def report(records: list[StepRecord], *, group_start: bool, device: str = "cpu", final: bool = False) -> WorkerReport:
    done = FinalInfo(samples=64 * records[-1].step, steps=records[-1].step, eval={}, precision="fp32", wall_s=1.0)
    return WorkerReport(records=records, layout={}, total_steps=records[-1].step, step=records[-1].step,
                        group_start=group_start, device=device, final=done if final else None)


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_resize_from_2_to_1_workers_costs_each_step_at_its_own_size_and_the_gap_at_the_smaller(tmp_path):
    run_dir = run_dir_with(tmp_path, ["scaling.cpus_per_worker=2", "scaling.min_workers=1",
                                      "cost.instance_type=m5.2xlarge"])
    two = group(1, 10, 2, START, 0.5)                       # 10 steps at 2 workers, ends at START + 5
    one = group(8, 20, 1, START + 5 + 30, 0.8)              # restart 30 s later at step 8: steps 8-10 redone
    writer = MetricsWriter(run_dir, progress=False)
    writer.write(report(two[:5], group_start=True), world_size=2)
    writer.write(report(two[5:], group_start=False), world_size=2)
    writer.write(report(one, group_start=True, final=True), world_size=1)

    m5 = MACHINES["m5.2xlarge"]
    per_core_hour = m5["on_demand"] / m5["vcpus"]
    core_seconds = 10 * 0.5 * 2 * 2 + 30 * 1 * 2 + 13 * 0.8 * 1 * 2   # steps x step_s x workers x cores, + gap
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["device_hours"] == pytest.approx(core_seconds / 3600)
    assert summary["cost_usd"] == pytest.approx(core_seconds / 3600 * per_core_hour)
    assert summary["pricing"]["unit"] == "CPU core" and summary["pricing"]["units_per_worker"] == 2
    written = lines(run_dir)
    assert len(written) == 23 and written[-1]["cost_usd"] == pytest.approx(summary["cost_usd"])
    assert written[9]["device_hours"] == pytest.approx(10 * 0.5 * 2 * 2 / 3600)      # the running total at step 10
    assert all(a["cost_usd"] < b["cost_usd"] for a, b in zip(written, written[1:]))


def test_a_restart_in_place_continues_the_totals_of_metrics_jsonl(tmp_path):
    run_dir = run_dir_with(tmp_path, ["cost.prices.cpu_core=0.5", "scaling.min_workers=1", "scaling.max_workers=1"])
    MetricsWriter(run_dir, progress=False).write(report(group(1, 4, 1, START, 1.0), group_start=True), world_size=1)
    again = MetricsWriter(run_dir, progress=False)          # torchrun restarted rank 0: a new writer, same directory
    again.write(report(group(5, 6, 1, START + 4 + 20, 2.0), group_start=True, final=True), world_size=1)
    seconds = 4 * 1.0 + 20 + 2 * 2.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["device_hours"] == pytest.approx(seconds / 3600)
    assert summary["cost_usd"] == pytest.approx(seconds / 3600 * 0.5)


@pytest.mark.parametrize("overrides, device, per_gpu_hour", [
    ([], "NVIDIA A10G", min(m["on_demand"] / m["gpus"] for m in MACHINES.values() if m.get("accelerator") == "A10G")),
    (["cost.instance_type=g5.12xlarge"], "NVIDIA A10G", MACHINES["g5.12xlarge"]["on_demand"] / 4),
    (["cost.instance_type=g5.12xlarge", "cost.spot=true"], "NVIDIA A10G", MACHINES["g5.12xlarge"]["spot"] / 4),
    (["cost.instance_type=g5.12xlarge", "cost.prices.g5.12xlarge=4.0"], "NVIDIA A10G", 1.0),
    (["cost.instance_type=n1-standard-8+2xnvidia-tesla-t4"], "Tesla T4",
     (MACHINES["n1-standard-8"]["on_demand"] + 2 * TABLE["accelerators"]["T4"]["attach"]["on_demand"]) / 2),
    ([], "Tesla T4", MACHINES["n1-standard-8"]["on_demand"] + TABLE["accelerators"]["T4"]["attach"]["on_demand"]),
    ([], "NVIDIA L4", MACHINES["g2-standard-8"]["on_demand"]),
    (["cost.prices.H100=2.5"], "NVIDIA H100 80GB HBM3", 2.5),
])
def test_gpu_runs_are_priced_per_gpu_hour(tmp_path, overrides, device, per_gpu_hour):
    run_dir = run_dir_with(tmp_path, ["scaling.gpus_per_worker=1", *overrides])
    MetricsWriter(run_dir, progress=False).write(report(group(1, 6, 2, START, 3.0), group_start=True, device=device,
                                                        final=True), world_size=2)
    summary = json.loads((run_dir / "summary.json").read_text())
    gpu_hours = 6 * 3.0 * 2 / 3600
    assert summary["device_hours"] == pytest.approx(gpu_hours) and summary["pricing"]["unit"] == "GPU"
    assert summary["cost_usd"] == pytest.approx(gpu_hours * per_gpu_hour)


def test_a_gpu_without_a_price_counts_its_hours_and_says_how_to_price_it(tmp_path):
    run_dir = run_dir_with(tmp_path, [])
    MetricsWriter(run_dir, progress=False).write(report(group(1, 3, 1, START, 1.0), group_start=True,
                                                        device="NVIDIA H100 80GB HBM3", final=True), world_size=1)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["device_hours"] == pytest.approx(3 / 3600) and summary["cost_usd"] is None
    assert "cost.prices" in summary["pricing"]["priced_as"] and "cost_usd" not in lines(run_dir)[-1]


def test_the_progress_line_shows_device_hours_and_dollars(tmp_path, capsys):
    run_dir = run_dir_with(tmp_path, ["cost.prices.cpu_core=36", "scaling.min_workers=1", "scaling.max_workers=1"])
    MetricsWriter(run_dir, progress=True).write(report(group(1, 2, 1, START, 50.0), group_start=True), world_size=1)
    assert "0.0278 core-h $1.00" in capsys.readouterr().err    # 100 core-seconds at $36 per core-hour


def test_a_local_cpu_run_shows_core_hours_and_no_price(tmp_path, capsys):
    run_dir = run_dir_with(tmp_path, ["scaling.min_workers=1", "scaling.max_workers=1"])
    MetricsWriter(run_dir, progress=True).write(report(group(1, 2, 1, START, 0.1), group_start=True, final=True),
                                                world_size=1)
    err = capsys.readouterr().err
    assert " 0.0000556 core-h" in err and "$" not in err            # 0.2 core-seconds, never 5.56e-05
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["cost_usd"] is None and summary["device_hours"] == pytest.approx(0.2 / 3600)
    assert "cost.prices.cpu_core" in summary["pricing"]["priced_as"]


@pytest.mark.parametrize("usd, shown", [
    (None, "-"), (0.0, "$0.00"), (0.000021, "< $0.01"), (0.0099, "< $0.01"), (0.01, "$0.01"), (0.12, "$0.12"),
    (12.34, "$12.34"), (1234.5, "$1,234.50"),
])
def test_dollars_are_written_as_dollars(usd, shown):
    assert format_usd(usd) == shown


@pytest.mark.parametrize("hours, shown", [(0.0, "0"), (0.2 / 3600, "0.0000556"), (0.0278, "0.0278"), (12.34, "12.3"),
                                          (1234.4, "1,234")])
def test_device_hours_keep_three_digits_without_exponents(hours, shown):
    assert format_hours(hours) == shown


@pytest.mark.parametrize("overrides, message", [
    (["cost.instance_type=p5.48xlarge"], r"'cost.instance_type' is 'p5.48xlarge', which is not a machine of"),
    (["cost.instance_type=n1-standard-8+nvidia-h100"], r"'nvidia-h100' is not a GPU that .* prices per attached GPU"),
])
def test_an_unknown_machine_fails_before_anything_is_written(tmp_path, overrides, message):
    cfg = load_config(None, [f"run.runs_dir={tmp_path / 'runs'}", *overrides])
    with pytest.raises(ConfigError, match=message):
        prepare_run(cfg)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value", ["-1", "nan", "cheap", "true"])
def test_a_price_must_be_a_number(value):
    with pytest.raises(ConfigError, match=r"'cost.prices.A10G' is .*not a price"):
        load_config(None, [f"cost.prices.A10G={value}"])


def test_a_broken_price_table_names_the_entry(tmp_path):
    bad = tmp_path / "prices.yaml"
    broken = yaml.safe_load(TABLE_PATH.read_text())
    broken["machines"]["g5.2xlarge"]["spot"] = "cheap"
    bad.write_text(yaml.safe_dump(broken))
    from raydl.telemetry.cost import PriceTable

    with pytest.raises(ConfigError, match=r"machines.g5.2xlarge.spot' is 'cheap'"):
        PriceTable.load(bad)


def test_every_price_has_a_date_and_a_source():
    priced = [*MACHINES.values(), *(a["attach"] for a in TABLE["accelerators"].values() if "attach" in a)]
    assert priced and all(p["date"] and p["source"].startswith("https://") for p in priced)
    m5 = Pricing.for_config(load_config(None, ["cost.instance_type=m5.2xlarge"])).rate("cpu")
    assert m5.usd_per_unit_hour == MACHINES["m5.2xlarge"]["on_demand"] / 8 and "m5.2xlarge" in m5.priced_as
    assert Pricing.for_config(load_config(None, [])).rate("cpu").usd_per_unit_hour is None   # no machine named
