"""TensorBoard events (telemetry.tensorboard) written by the real metrics writer and read back with TensorBoard's
own reader; the missing extra is refused before any run directory or Ray exists.

`write_run` is also the run maker of the report tests: a run directory written by raydl's MetricsWriter from
worker reports, as the Ray Train controller writes it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from raydl.cli import main
from raydl.config import JobConfig
from raydl.metrics import tensorboard
from raydl.metrics.writer import MetricsWriter
from raydl.errors import ConfigError
from raydl.overrides import dump_yaml, load_config
from raydl.telemetry.records import FinalInfo, StepRecord, WorkerReport

GROUP_GAP_S = 10.0
GPU = {"gpu_util_pct": 87.0, "gpu_mem_used_mb": 30000.0, "gpu_power_w": 310.0, "gpu_temp_c": 61.0}


def record(step: int, world_size: int, time: float, *, gpu: bool = False, eval_every: int = 10) -> StepRecord:
    """A step whose every number depends on the step and the world size, so a value in the wrong place shows."""
    return StepRecord(step=step, epoch=step // 50, loss=6.0 / step ** 0.5, lr=1e-4 * min(step, 10), grad_norm=1 + step / 7,
                      samples=64, world_size=world_size, time=time, step_s=0.4 + 0.1 / world_size,
                      data_wait_s=0.01 * world_size, data_wait_frac=0.02 * world_size + step / 1000,
                      samples_per_s=100.0 * world_size + step, tokens_per_s=400.0 * world_size + step, bad_shards=0,
                      peak_memory_mb=500.0 + step, model_tflops_per_s=0.01 * world_size,
                      gpu={k: v + step for k, v in GPU.items()} if gpu else {},
                      eval_loss=5.0 / step ** 0.5 if step % eval_every == 0 else None)


def layout(world_size: int) -> dict:
    return {"world_size": world_size, "dp": world_size, "pp": 1, "num_microbatches": 1, "micro_batch": 64 // world_size,
            "schedule": "none"}


def write_run(run_dir: Path, groups: list[tuple[int, int, int]], *, every: int = 5, events_dir: str | None = None,
              gpu: bool = False, final: bool = True, core_hour_usd: float | None = None,
              trackers: dict | None = None) -> MetricsWriter:
    """Worker groups (world size, first step, last step) reported every `every` steps, a step a second and
    GROUP_GAP_S between groups; a group that starts at or before the previous one's last step redoes those
    steps, as after a restart from an earlier checkpoint. With `core_hour_usd` the run's config prices its CPU
    core-hours (without a price no $ is recorded). `trackers`: raydl.metrics.trackers settings."""
    if core_hour_usd is not None:
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(dump_yaml(load_config(None, [f"cost.prices.cpu_core={core_hour_usd}"])))
    writer = MetricsWriter(run_dir, progress=False, events_dir=events_dir, trackers=trackers)
    last, clock = groups[-1][2], 1.7e9
    for world_size, first, end in groups:
        clock += GROUP_GAP_S - 1
        for start in range(first, end + 1, every):
            steps = range(start, min(start + every - 1, end) + 1)
            done = final and steps[-1] == last
            records = [record(s, world_size, clock + i, gpu=gpu) for i, s in enumerate(steps, start=1)]
            clock = records[-1].time
            writer.write(WorkerReport(records=records, layout=layout(world_size),
                                      total_steps=last, step=steps[-1], group_start=start == first,
                                      final=FinalInfo(samples=64 * last, steps=last, eval={"loss": 1.25, "accuracy": 0.5},
                                                      precision="fp32", wall_s=2.0 * last) if done else None),
                         world_size=world_size, checkpoint=str(run_dir / "train" / f"step_{steps[-1]:08d}"))
    return writer


def read_events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})   # 0: keep every event
    events.Reload()
    return events


def texts(events, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")}


def latest_lines(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step, a redone step's later line replacing the earlier one."""
    return {line["step"]: line for line in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def assert_events_match_metrics(run_dir: Path, log_dir: Path) -> set[str]:
    """Every number of every metrics.jsonl line is a scalar at its step and wall time; returns the tags."""
    lines, events = latest_lines(run_dir), read_events(log_dir)
    expected: dict[str, dict[int, float]] = {}
    for step, line in lines.items():
        for name, value in tensorboard.scalars(line).items():
            expected.setdefault(name, {})[step] = value
    assert set(events.Tags()["scalars"]) == expected.keys()
    for name, values in expected.items():
        got = {e.step: e.value for e in events.Scalars(name)}
        assert got == pytest.approx(values, rel=1e-6), name   # float32 in the event file
    first = events.Scalars("loss/loss")[0]
    assert first.wall_time == pytest.approx(lines[first.step]["time"])
    return set(expected)


def test_events_hold_every_metric_with_restarts_and_layouts_as_text(tmp_path):
    run = tmp_path / "run"
    write_run(run, [(2, 1, 12), (1, 11, 20)], events_dir=str(run / "tensorboard"), gpu=True, core_hour_usd=36.0)

    tags = assert_events_match_metrics(run, run / "tensorboard")
    assert {"loss/loss", "loss/eval_loss", "optimizer/lr", "optimizer/grad_norm", "throughput/samples_per_s",
            "time/data_wait_frac", "memory/peak_memory_mb", "memory/gpu_mem_used_mb", "gpu/gpu_util_pct",
            "gpu/gpu_power_w", "run/world_size", "cost/device_hours", "cost/cost_usd"} <= tags
    events = read_events(run / "tensorboard")
    # Steps 11 and 12 were redone at 1 worker: the reader keeps those values, not the first group's.
    assert {e.step: e.value for e in events.Scalars("run/world_size")}[12] == 1
    # seconds lost: the 10 s between the groups less the new step's own 0.5 s, and 2 redone steps of 0.45 s
    assert texts(events, "events/restarts") == {
        11: "resize 2 -> 1 workers after step 12: resumed at step 10, 2 steps redone, 10.4 s lost"}
    layouts = texts(events, "events/layouts")
    assert sorted(layouts) == [1, 11] and layouts[1].startswith("2 workers from step 1: dp 2 x pp 1")
    assert layouts[11].startswith("1 workers from step 11: dp 1 x pp 1")


def test_tags_group_known_keys_and_keep_unknown_numbers():
    line = {"step": 3, "time": 1.7e9, "loss": 2.5, "gpu_power_w": 300.0, "cost_usd": 0.02, "flag": True, "note": "x",
            "my_metric": 7}
    assert tensorboard.scalars(line) == {"loss/loss": 2.5, "gpu/gpu_power_w": 300.0, "cost/cost_usd": 0.02,
                                         "other/my_metric": 7}


def test_events_dir_is_the_run_dir_or_what_a_sweep_chose_and_none_when_off(tmp_path):
    on = load_config(None, ["telemetry.tensorboard=true"])
    assert tensorboard.events_dir(on, {"run_dir": str(tmp_path)}) == str(tmp_path / "tensorboard")
    chosen = {"run_dir": str(tmp_path), tensorboard.JOB_KEY: str(tmp_path / "sweep" / "tensorboard" / "t1")}
    assert tensorboard.events_dir(on, chosen) == chosen[tensorboard.JOB_KEY]
    assert JobConfig().telemetry.tensorboard is False
    assert tensorboard.events_dir(JobConfig(), {"run_dir": str(tmp_path)}) is None


@pytest.fixture
def without_tensorboard(monkeypatch):
    """The extra not installed: importing tensorboard fails as it does when the package is absent."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)


def test_the_flag_without_the_extra_is_a_config_error_naming_the_install(without_tensorboard):
    with pytest.raises(ConfigError, match=r'telemetry.tensorboard.*pip install "raydl\[tensorboard\]"'):
        tensorboard.require_installed(load_config(None, ["telemetry.tensorboard=true"]))
    tensorboard.require_installed(JobConfig())   # off: nothing to install


def test_raydl_train_refuses_before_ray_starts_and_writes_nothing(without_tensorboard, tmp_path, capsys):
    import ray

    started = ray.is_initialized()
    code = main(["train", "--set", "telemetry.tensorboard=true", "--set", f"run.runs_dir={tmp_path / 'runs'}"])

    assert code == 2 and 'pip install "raydl[tensorboard]"' in capsys.readouterr().err
    assert ray.is_initialized() == started and not (tmp_path / "runs").exists()
