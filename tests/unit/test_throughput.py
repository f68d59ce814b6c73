"""Throughput as a stopwatch sees it: the writer's samples/s is samples over elapsed wall time (reports, evals,
checkpoints and restarts between steps included), the median per-step rate is `step_rate`, and `time_in` adds
up to the wall time. Records are built by hand with known times; the writer is the real one."""

from __future__ import annotations

import json
import time

import pytest
import torch

from raydl.metrics.stopwatch import stopwatch
from raydl.metrics.writer import MetricsWriter
from raydl.telemetry.records import FinalInfo, StepRecord, WorkerReport
from raydl.telemetry.step_clock import StepClock

START = 1.8e9
BATCH = 64


def record(n: int, end: float, step_s: float, *, between_s: float = 0.0, report_s: float = 0.0,
           checkpoint_s: float = 0.0, eval_s: float | None = None) -> StepRecord:
    return StepRecord(step=n, epoch=0, loss=1.0, lr=1e-3, grad_norm=1.0, samples=BATCH, world_size=2, time=end,
                      step_s=step_s, between_s=between_s, report_s=report_s, checkpoint_s=checkpoint_s,
                      eval_s=eval_s, data_wait_s=0.0, data_wait_frac=0.0, samples_per_s=BATCH / step_s,
                      tokens_per_s=8 * BATCH / step_s, bad_shards=0, peak_memory_mb=1.0)


def steps_with_reports(n: int, *, step_s: float, every: int, report_s: float, start: float = START,
                       first: int = 1) -> list[StepRecord]:
    """n steps of step_s each; after every `every`-th step a report of report_s, in the next step's between_s."""
    out, t = [], start
    for i, number in enumerate(range(first, first + n)):
        between = report_s if i and (number - 1) % every == 0 else 0.0
        t += between + step_s
        out.append(record(number, t, step_s, between_s=between, report_s=between))
    return out


def final(records: list[StepRecord]) -> FinalInfo:
    return FinalInfo(samples=BATCH * records[-1].step, steps=records[-1].step, eval={}, precision="fp32", wall_s=1.0)


def write(tmp_path, groups: list[list[StepRecord]]) -> dict:
    writer = MetricsWriter(tmp_path, progress=False)
    for i, records in enumerate(groups):
        last = i == len(groups) - 1
        writer.write(WorkerReport(records=records, layout={}, total_steps=records[-1].step, step=records[-1].step,
                                  group_start=True, final=final(records) if last else None), world_size=2)
    return json.loads((tmp_path / "summary.json").read_text())


def test_reports_between_steps_lower_the_wall_clock_rate_but_not_the_step_rate(tmp_path):
    records = steps_with_reports(100, step_s=0.03, every=10, report_s=0.2)   # the stall issue 26 measured
    summary = write(tmp_path, [records])
    steady = records[20:]
    elapsed = steady[-1].time - records[19].time
    assert summary["samples_per_s"] == pytest.approx(BATCH * len(steady) / elapsed)
    assert summary["step_rate"] == pytest.approx(BATCH / 0.03)
    assert summary["samples_per_s"] == pytest.approx(BATCH / (0.03 + 0.02), rel=0.02)   # 0.6 of the step rate
    assert summary["tokens_per_s"] == pytest.approx(8 * summary["samples_per_s"])


def test_time_in_adds_up_to_the_wall_time_and_names_reports_checkpoints_evals(tmp_path):
    records = steps_with_reports(30, step_s=0.05, every=10, report_s=0.01)
    records[14].eval_s = 0.5                                     # an eval after step 15, before step 16
    records[15] = record(16, records[15].time + 0.5 + 0.3, 0.05, between_s=0.5 + 0.3 + records[15].between_s,
                         checkpoint_s=0.3)
    for r in records[16:]:
        r.time += 0.8
    time_in = write(tmp_path, [records])["time_in"]
    assert time_in["steps"] == pytest.approx(30 * 0.05)
    assert time_in["reports"] == pytest.approx(2 * 0.01)
    assert time_in["eval"] == pytest.approx(0.5) and time_in["checkpoint"] == pytest.approx(0.3)
    assert time_in["wall"] == pytest.approx(records[-1].time - (START + 0.0))
    named = sum(v for k, v in time_in.items() if k != "wall")
    assert named == pytest.approx(time_in["wall"], abs=1e-3)


def test_a_restart_counts_in_the_wall_time_and_redone_steps_count_once(tmp_path):
    before = steps_with_reports(50, step_s=0.1, every=10, report_s=0.0)
    after = steps_with_reports(60, step_s=0.1, every=10, report_s=0.0, start=before[-1].time + 10.0, first=41)
    summary = write(tmp_path, [before, after])
    assert summary["time_in"]["restarts"] == pytest.approx(10.0)
    assert summary["restarts"][0]["steps_redone"] == 10
    rate, elapsed = stopwatch(before + after)
    assert elapsed == pytest.approx(before[-1].time + 10.0 + 6.0 - START)
    assert rate == pytest.approx(100 * BATCH / elapsed)           # steps 1-100, the redone 41-50 counted once


def test_the_step_clock_keeps_the_time_between_steps_out_of_the_step():
    clock = StepClock()
    clock.begin()
    first = clock.record(step=1, epoch=0, loss=1.0, lr=0.1, grad_norm=1.0, samples=BATCH, world_size=1,
                         data_wait_s=0.0, bad_shards=0, device=torch.device("cpu"), gpu={})
    clock.spend("report", 0.25)
    busy_until = time.perf_counter() + 0.05
    while time.perf_counter() < busy_until:   # time between steps that nobody named
        pass
    clock.begin()
    second = clock.record(step=2, epoch=0, loss=1.0, lr=0.1, grad_norm=1.0, samples=BATCH, world_size=1,
                          data_wait_s=0.0, bad_shards=0, device=torch.device("cpu"), gpu={})
    assert second.between_s >= 0.05 and second.step_s < 0.05
    assert second.report_s == 0.25 and first.report_s == 0.0
    assert second.time - first.time == pytest.approx(second.elapsed_s, abs=5e-3)
