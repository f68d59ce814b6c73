"""The benchmark harness: statistics, alternation order, the result file's schema, the shared arguments,
and the /proc reading that describes the machine. Sides here are tiny pure functions that drive it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raydl.bench import harness, procs
from raydl.errors import ConfigError


def test_summary_has_median_extremes_spread_and_the_runs_in_order():
    stats = harness.summary([3.0, 1.0, 2.0, 10.0, 4.0])
    assert stats == {"median": 3.0, "min": 1.0, "max": 10.0, "spread": 3.0, "runs": [3.0, 1.0, 2.0, 10.0, 4.0]}
    assert harness.summary([-1.0, 0.0, 1.0])["spread"] is None   # no spread relative to a zero median


def test_ratio_is_of_the_medians_not_the_mean():
    assert harness.ratio_of_medians([2.0, 4.0, 100.0], [1.0, 2.0, 3.0]) == pytest.approx(2.0)


def test_paired_ratios_divide_each_round_by_its_own_partner():
    # the machine ran at half speed in round 2: both sides slowed, the round's ratio did not
    stats = harness.paired_ratios([8.0, 4.0, 9.0], [10.0, 5.0, 10.0])
    assert stats["runs"] == pytest.approx([0.8, 0.8, 0.9]) and stats["median"] == pytest.approx(0.8)
    assert harness.ratio_of_medians([8.0, 4.0, 9.0], [10.0, 5.0, 10.0]) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        harness.paired_ratios([1.0], [1.0, 2.0])


def test_summarize_takes_the_numbers_every_run_has():
    runs = [{"rate": 2.0, "steps": 3, "ok": True, "name": "a", "redone": 1, "extra": {"x": 1}},
            {"rate": 4.0, "steps": 5, "ok": False, "name": "b", "redone": None, "extra": {"x": 2}}]
    stats = harness.summarize(runs)
    assert set(stats) == {"rate", "steps"}
    assert stats["rate"]["median"] == 3.0 and stats["steps"]["runs"] == [3, 5]


def test_alternate_runs_the_sides_in_turn_each_round():
    calls = []

    def side(name):
        def run():
            calls.append(name)
            return {"value": float(len(calls))}
        return run

    runs = harness.alternate({"a": side("a"), "b": side("b"), "c": side("c")}, 3, verbose=False)
    assert calls == ["a", "b", "c"] * 3
    assert [r["value"] for r in runs["b"]] == [2.0, 5.0, 8.0]


def test_result_file_holds_the_machine_the_args_and_the_body(tmp_path, capsys):
    p = harness.parser("fake", "a fake benchmark")
    args = harness.parse_args(p, ["--repeats", "3", "--out", str(tmp_path / "results" / "fake.json")])
    session = harness.Session("fake", args)
    runs = harness.alternate({"a": lambda: {"rate": 1.0}, "b": lambda: {"rate": 3.0}}, args.repeats)
    session.write(sides={side: harness.summarize(r) for side, r in runs.items()})
    assert "3/3 b: rate 3" in capsys.readouterr().out
    result = json.loads((tmp_path / "results" / "fake.json").read_text())
    assert {"benchmark", "machine", "args", "repeats", "wall_s", "sides"} <= set(result)
    assert result["benchmark"] == "fake" and result["repeats"] == 3 and result["args"]["repeats"] == 3
    assert {"nproc", "cpu_model", "date", "python", "load_avg_1m_at_start", "load_avg_1m_at_end",
            "busiest_other_processes"} <= set(result["machine"])
    assert result["sides"]["b"]["rate"] == {"median": 3.0, "min": 3.0, "max": 3.0, "spread": 0.0,
                                            "runs": [3.0, 3.0, 3.0]}


def test_shared_arguments_default_to_five_repeats_and_a_results_file():
    args = harness.parse_args(harness.parser("fake", None), [])
    assert args.repeats == 5 and args.out == "benchmarks/results/fake-cpu.json"
    with pytest.raises(ConfigError, match="--repeats"):
        harness.parse_args(harness.parser("fake", None), ["--repeats", "0"])


def test_descendants_follow_the_parent_links():
    table = {2: (1, 0), 3: (2, 0), 4: (3, 0), 5: (9, 0)}
    assert sorted(procs.descendants(1, table)) == [2, 3, 4]


def test_busiest_leaves_out_this_process_tree():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busiest = procs.busiest(count=50)
    finally:
        child.kill()
        child.wait()
    assert child.pid not in {p["pid"] for p in busiest}
    assert all(p["cpu_pct"] > 0 and isinstance(p["cmd"], str) for p in busiest)
