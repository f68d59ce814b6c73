"""`raydl bench first_step` end to end on CPU, tiny model: both sides run under torchrun (one process), and the
result file holds each side's command -> first step with its phases, the peak memory and the ratio."""

from __future__ import annotations

import json

import pytest

from raydl.bench import first_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_first_step_bench_times_both_builds(tmp_path):
    out = tmp_path / "first-step.json"
    assert first_step.main(["--models", "gpt-tiny", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["models"]["gpt-tiny"]
    for side in ("before", "after"):
        stats = result["sides"][side]
        phases = [k for k in stats if k.startswith("phase:")]
        assert {"phase:model_built", "phase:first_step"} <= set(phases), phases
        total = stats["to_first_step_s"]["median"]
        assert 0 < sum(stats[k]["median"] for k in phases) <= total + 1e-6 and stats["peak_memory_mib"]["median"] > 0
    assert result["after_over_before"] > 0
