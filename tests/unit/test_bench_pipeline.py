"""Pure parts of `raydl bench pipeline`: config filter, bubble arithmetic, goals, saved-bytes accounting, sleeps."""

from __future__ import annotations

import pytest
import torch

from raydl.bench.pipeline_model import Block, Clock, SavedBytes
from raydl.bench.pipeline_report import accepted_configs, check_goals, formula_bubble, markdown_table, per_step
from raydl.parallel.schedules import NAMES


def test_accepted_configs_follow_torchs_schedule_constraints():
    accepted, skipped = accepted_configs(NAMES, [1, 2, 4, 8], batch=64)
    assert set(skipped) == {"1f1b m=1", "dualpipev m=1", "dualpipev m=2"}
    assert "num_microbatches >= pp" in skipped["1f1b m=1"] and "2*pp = 4" in skipped["dualpipev m=2"]
    assert len(accepted) == 7 * 4 - 3 and ("dualpipev", 4) in accepted and ("zbv", 1) in accepted


def test_formula_only_for_gpipe_and_1f1b():
    assert formula_bubble("gpipe", 1) == pytest.approx(0.5)
    assert formula_bubble("1f1b", 8) == pytest.approx(1 / 9)
    assert formula_bubble("zbv", 8) is None


def test_per_step_takes_slowest_rank_and_busiest_rank():
    steps = per_step(step_by_rank=[[1.0, 2.0], [1.2, 1.9]], busy_by_rank=[[0.6, 1.5], [0.9, 1.0]])
    assert steps["step_s"] == [1.2, 2.0] and steps["busy_s"] == [0.9, 1.5]
    assert steps["bubble"] == pytest.approx([0.25, 0.25])


def _row(schedule, m, bubble, step_s, peak=(100, 100)):
    return {"schedule": schedule, "m": m, "bubble": bubble, "step_s": step_s, "busy_s": step_s * (1 - bubble),
            "formula_bubble": formula_bubble(schedule, m), "planner_bubble": 0.1, "planner_step_s": step_s,
            "step_error_pct": 0.0, "step_error_measured_pass_pct": 0.0, "peak_saved_bytes": list(peak),
            "in_flight_microbatches": [4.0, 4.0], "planner_activation_bytes": list(peak)}


def test_goals_pass_and_fail_on_the_numbers():
    good = [_row("gpipe", 4, 0.23, 0.62, (400, 400)), _row("1f1b", 4, 0.24, 0.63, (200, 100)),
            _row("zbv", 4, 0.12, 0.55)]
    goals = check_goals(good)
    assert all(goal["pass"] for goal in goals.values())
    assert goals["formula_within_5_points"]["rows"][1]["diff_points"] == pytest.approx(4.0)
    bad = [_row("gpipe", 4, 0.26, 0.62, (400, 400)), _row("1f1b", 4, 0.24, 0.63, (400, 100)),
           _row("zbv", 4, 0.23, 0.62)]   # 6 points off; zbv only 1 point better; 1f1b rank 0 as full as gpipe
    assert not any(goal["pass"] for goal in check_goals(bad).values())
    assert markdown_table(good).count("\n") == 4 and "| zbv | 4 |" in markdown_table(good)


def test_saved_bytes_counts_activations_until_backward_frees_them():
    block = Block(8)
    x = torch.randn(4, 8)
    tracker = SavedBytes(exclude=block.parameters())
    with tracker.hooks():
        outs = [block(x[:2]), block(x[2:])]   # two micro-batches in flight, as GPipe keeps them
    micro = 2 * 8 * 4                          # bytes of one (2, 8) fp32 tensor
    assert tracker.peak == 2 * (2 * micro)     # each saves its input (for dW) and the GELU input; no weights
    sum(o.sum() for o in outs).backward()
    assert tracker.current == 0 and tracker.peak == 4 * micro


def test_saved_bytes_counts_a_tensor_saved_twice_once():
    x = torch.randn(16, requires_grad=True)
    tracker = SavedBytes()
    with tracker.hooks():
        y = x * x   # mul saves both operands: the same tensor
    assert tracker.peak == 16 * 4
    del y
    assert tracker.current == 0


def test_sleeps_follow_the_zero_bubble_split_of_backward():
    clock = Clock()
    block = Block(8, clock, cost_s=0.001)
    x = torch.randn(2, 8, requires_grad=True)
    out = block(x)
    torch.autograd.grad(out.sum(), [x], retain_graph=True)   # the I step: input gradient only
    assert clock.counts == {"F": 1, "B": 1, "W": 0}
    torch.autograd.grad(out.sum(), [block.fc.weight])        # the W step's path to the weight
    assert clock.counts["W"] == 1 and clock.busy_s >= 0.003
