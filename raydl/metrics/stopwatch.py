"""Throughput as a stopwatch sees it: samples over the elapsed wall time of consecutive steps (pure; shared by the
metrics writer and the sweep report)."""

from __future__ import annotations

from raydl.telemetry.records import StepRecord


def wall_clock(steps: list[tuple[int, int, float, float]]) -> tuple[float, float]:
    """(samples/s, elapsed s) of consecutive steps, each (step, samples, end time, elapsed_s), as a stopwatch sees
    them: their samples (a step redone after a restart counted once) over the wall time from before the first one
    to the last one's end, with whatever ran between them."""
    if not steps:
        return 0.0, 0.0
    elapsed = steps[-1][2] - (steps[0][2] - steps[0][3])
    samples = sum({step: n for step, n, _, _ in steps}.values())
    return (samples / elapsed if elapsed > 0 else 0.0), elapsed


def stopwatch(records: list[StepRecord]) -> tuple[float, float]:
    return wall_clock([(r.step, r.samples, r.time, r.elapsed_s) for r in records])
