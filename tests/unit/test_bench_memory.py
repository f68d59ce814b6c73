"""raydl bench memory's arithmetic on made-up peaks: what build/load added, the run above the tiny model, the
error of the prediction and the issue's targets."""

from __future__ import annotations

from raydl.bench import harness
from raydl.bench.memory import analyse, targets


def _run(built: float, end: float, first_step_s: float) -> dict:
    """A run whose worker grew by 70 MiB building its model on meta (the model's library imported)."""
    return {"to_first_step_s": first_step_s, **{f"rank{r}:{k}": v for r in (0, 1) for k, v in
            (("start_mib", 460), ("meta_now_mib", 530), ("built_mib", 460 + built), ("end_mib", 600 + end),
             ("pp_rank", 0))}}


def test_peaks_are_read_against_the_workers_start_the_tiny_model_and_the_prediction():
    tiny = harness.summarize([_run(0, 0, 10)] * 3)
    prediction = {"peak_mib_by_pp_rank": [1400.0], "breakdown": "", "share_mib": 600.0, "model_mib": 1200.0}
    sides = {"before": harness.summarize([_run(1700, 2400, 60)] * 3),
             "after": harness.summarize([_run(660, 1330, 33), _run(650, 1330, 30), _run(640, 1330, 27)])}
    row = analyse("gpt-1b", "dp2-fsdp", sides, tiny, prediction)
    after = row["after"]["ranks"][0]
    assert after["build_mib"] == 650 and after["build_over_share"] == round(650 / 600, 3)
    assert after["load_mib"] == 580 and after["load_over_share"] == round(580 / 600, 3)
    assert "load_mib" not in row["before"]["ranks"][0]   # built whole before the meta mark: not comparable
    assert after["run_above_tiny_mib"] == 1330 and after["prediction_error"] == round(1330 / 1400 - 1, 3)
    assert row["first_step_after_over_before"] == 0.5
    met = targets([row])
    assert met["build_over_share"]["worst"] == round(580 / 600, 3) and met["prediction_error"]["met"]
    assert met["build_from_start_over_share"]["worst"] == round(650 / 600, 3)
    assert met["first_step_after_over_before"]["met"] and not met["fsdp_run_over_model"]["met"]   # 1.11 > 0.75


def test_a_mark_writes_the_peak_and_the_current_resident_size(tmp_path):
    import json

    import torch

    from raydl.telemetry.memory_marks import MemoryMarks

    marks = MemoryMarks(str(tmp_path))
    held = torch.ones(64 * 2**18)   # 64 MiB, touched
    marks.mark("meta")
    del held
    marks.mark("built")
    written = json.loads((tmp_path / "memory-rank0.json").read_text())
    assert written["meta_now_mib"] > 64 and written["meta_peak_mib"] <= written["built_peak_mib"]
    assert written["built_now_mib"] < written["meta_now_mib"] - 32   # the current size falls, the peak does not
