"""A sweep's cost column and the cost_to_target objective, from the running cost of each attempt's metrics.jsonl."""

from __future__ import annotations

import csv

import pytest

from raydl.errors import ConfigError
from raydl.tune import report
from raydl.tune.space import parse_sweep
from raydl.tune.sweep import require_price


def attempt(losses: list[float], *, start: int, usd_per_step: float) -> list[dict]:
    """metrics.jsonl lines of one attempt (its own run directory): the running cost starts at 0."""
    return [{"step": start + i, "loss": loss, "samples": 64, "step_s": 1.0, "samples_per_s": 64.0,
             "peak_memory_mb": 1.0, "cost_usd": usd_per_step * (i + 1)} for i, loss in enumerate(losses)]


def test_cost_to_target_pays_the_lost_attempt_and_the_kept_one_up_to_the_target_step():
    first = attempt([3.0] * 12, start=1, usd_per_step=0.5)           # steps 1-12, then died; checkpoint at 10
    second = attempt([3.0] * 5 + [1.0] * 20, start=11, usd_per_step=0.25)   # resumed at 11: steps 11-35
    # train loss: the 10-step mean first reaches 1.0 at step 25, the 15th line of the second attempt
    cost = report.trial_cost([first, second], None, target=1.0, metric="train_loss")
    assert cost["cost_usd"] == pytest.approx(12 * 0.5 + 25 * 0.25)
    assert cost["cost_to_target_usd"] == pytest.approx(12 * 0.5 + 15 * 0.25)
    assert report.time_to_target(report.stitch([first, second]), None, target=1.0, metric="train_loss") == 25.0


def test_a_target_reached_before_a_restart_costs_only_the_first_attempt():
    first = attempt([1.0] * 12, start=1, usd_per_step=0.5)
    second = attempt([1.0] * 5, start=13, usd_per_step=0.25)
    cost = report.trial_cost([first, second], None, target=1.0, metric="train_loss")
    assert cost["cost_to_target_usd"] == pytest.approx(10 * 0.5) and cost["cost_usd"] == pytest.approx(7.25)


def test_final_eval_target_and_unknown_or_unreached_costs():
    one = attempt([2.0] * 4, start=1, usd_per_step=1.0)
    assert report.trial_cost([one], 0.9, target=1.0, metric="eval_loss")["cost_to_target_usd"] == 4.0
    assert report.trial_cost([one], None, target=1.0, metric="train_loss") == {"cost_usd": 4.0,
                                                                               "cost_to_target_usd": None}
    unpriced = [{k: v for k, v in line.items() if k != "cost_usd"} for line in one]
    assert report.trial_cost([unpriced], 0.9, target=1.0, metric="eval_loss") == {"cost_usd": None,
                                                                                 "cost_to_target_usd": None}
    assert report.trial_cost([], None, target=None, metric="train_loss") == {"cost_usd": 0.0,
                                                                             "cost_to_target_usd": None}


def test_the_cost_columns_and_the_cost_to_target_objective(tmp_path):
    spec = parse_sweep({"space": {"train.global_batch_size": [32, 64]}, "objective": "cost_to_target",
                        "target_loss": 1.5})
    rows = [{"trial": t, "params": {}, "batch": b, "precision": "fp32", "samples_per_s": 1.0, "peak_memory_mb": 1.0,
             "eval_loss": 1.4, "time_to_target_s": s, "cost_usd": c, "cost_to_target_usd": ct, "status": "ok",
             "reason": ""} for t, b, s, c, ct in (("t0", 32, 10.0, 0.5, 0.004), ("t1", 64, 8.0, 0.9, 0.7))]
    best = report.best_row(rows, *spec.metric)
    assert spec.metric == ("cost_to_target_usd", "min") and best["trial"] == "t0"   # slower, but cheaper
    header, _, t0, t1 = report.format_table(rows, [], best).splitlines()
    assert "  cost  " in header and "cost to target" in header
    assert "$0.50  < $0.01" in t0 and "$0.90  $0.70" in t1             # dollars as dollars, never 4e-03
    unpriced = [{**r, "cost_usd": None, "cost_to_target_usd": None} for r in rows]   # a local CPU sweep
    assert "cost" not in report.format_table(unpriced, [], best) and "$" not in report.format_table(unpriced, [], best)
    report.write_csv(rows, tmp_path / "r.csv", [])
    assert [r["cost_to_target_usd"] for r in csv.DictReader((tmp_path / "r.csv").open())] == ["0.004", "0.7"]


def test_cost_to_target_needs_a_target_loss():
    with pytest.raises(ConfigError, match="target_loss.*missing; the cost_to_target objective needs it"):
        parse_sweep({"space": {"train.global_batch_size": [32]}, "objective": "cost_to_target"})


def test_cost_to_target_on_cpus_needs_a_price():
    unpriced = parse_sweep({"space": {"train.global_batch_size": [32]}, "objective": "cost_to_target", "target_loss": 1.5})
    with pytest.raises(ConfigError, match=r"'objective' is cost_to_target, but the trials run on CPUs with no price "
                                          r"\(no price: .*cost.prices.cpu_core"):
        require_price(unpriced, gpu=False)
    require_price(unpriced, gpu=True)   # GPUs are priced by their name
    priced = parse_sweep({"space": {"train.global_batch_size": [32]}, "objective": "cost_to_target", "target_loss": 1.5,
                          "base": {"cost": {"prices": {"cpu_core": 0.05}}}})
    require_price(priced, gpu=False)
