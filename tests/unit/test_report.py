"""`raydl report` on run and sweep directories written by raydl's MetricsWriter: the PNG read back, the table's
numbers against summary.json, and bad input refused with exit 2 naming the path."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from PIL import Image

from raydl.cli import main
from raydl.report import source as report_source
from tests.unit.test_tensorboard import write_run

CORE_HOUR_USD = 36.0   # a cent per core-second: the tables' dollars are readable


def table_rows(out: str) -> list[list[str]]:
    """The printed table's cells (columns are two or more spaces apart), header first."""
    lines = [line for line in out.splitlines() if line and not line.startswith("[raydl]")]
    return [re.split(r"\s{2,}", line.strip()) for i, line in enumerate(lines) if i != 1]   # line 1: the dashes


def assert_png(path: Path) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (1500, 1200)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow   # matplotlib draws report.png
def test_run_report_prints_summary_json_as_a_table_and_draws_the_png(tmp_path, capsys):
    run = tmp_path / "run"
    # shrink, then grow again, each redoing steps
    write_run(run, [(2, 1, 60), (1, 53, 100), (2, 91, 150)], core_hour_usd=CORE_HOUR_USD)

    assert main(["report", str(run)]) == 0
    header, *rows = table_rows(capsys.readouterr().out)
    table, s = dict(rows), summary(run)
    assert header == ["field", "value"]
    assert int(table["steps"]) == s["steps"] == 150 and int(table["samples"]) == s["samples"]
    for field, key, scale in (("final loss", "final_loss", 1), ("samples/s", "samples_per_s", 1),
                              ("data wait %", "data_wait_frac", 100), ("peak memory MB", "peak_memory_mb", 1),
                              ("device-hours", "device_hours", 1)):
        assert float(table[field]) == pytest.approx(s[key] * scale, rel=2e-3, abs=0.5 if s[key] > 1000 else 0), field
    assert table["cost"].startswith("$") and float(table["cost"][1:]) == pytest.approx(s["cost_usd"], abs=0.005)
    assert float(table["eval loss"]) == s["eval"]["loss"]
    assert table["workers"] == "2, 1" and int(table["restarts"]) == len(s["restarts"]) == 2
    assert "MFU %" not in table   # no value on CPU: the column is left out
    assert_png(run / "report.png")
    markers = report_source.load(run).runs[0].markers
    assert [(m.step, m.kind) for m in markers] == [(53, "resize"), (91, "resize")]


@pytest.mark.slow   # matplotlib draws results.png
def test_sweep_report_has_a_line_per_trial_with_its_last_attempts_summary(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    (sweep / "trials" / "failed").mkdir(parents=True)   # a trial that failed before its first step
    (sweep / "sweep.yaml").write_text("name: sweep\n")
    # trial a was interrupted, then resumed
    write_run(sweep / "trials" / "a" / "attempt-1", [(1, 1, 40)], final=False, core_hour_usd=CORE_HOUR_USD)
    write_run(sweep / "trials" / "a" / "attempt-2", [(1, 31, 80)], core_hour_usd=CORE_HOUR_USD)
    write_run(sweep / "trials" / "b" / "attempt-1", [(2, 1, 50), (2, 41, 80)], core_hour_usd=CORE_HOUR_USD)
    (sweep / "results.json").write_text(json.dumps({"trials": [{"trial": "b", "params": {"train.lr": 0.01}}]}))

    assert main(["report", str(sweep), "--out", str(tmp_path / "sweep.png")]) == 0
    header, *rows = table_rows(capsys.readouterr().out)
    lines = {row[0]: dict(zip(header, row)) for row in rows}
    assert list(lines) == ["a", "b: lr=0.01", "failed"]
    for trial, run_dir in (("a", sweep / "trials" / "a" / "attempt-2"), ("b: lr=0.01", sweep / "trials" / "b" / "attempt-1")):
        s = summary(run_dir)
        assert int(lines[trial]["steps"]) == s["steps"] == 80
        assert float(lines[trial]["final loss"]) == pytest.approx(s["final_loss"], rel=1e-3)
        assert float(lines[trial]["samples/s"]) == pytest.approx(s["samples_per_s"], rel=1e-3)
        assert int(lines[trial]["restarts"]) == len(s["restarts"])
    assert lines["a"]["note"] == "figures of attempt-2; cost over all attempts" and lines["failed"]["note"] == "no steps"
    assert_png(tmp_path / "sweep.png")
    trial_a = report_source.load(sweep).runs[0]
    assert [r["step"] for r in trial_a.records] == list(range(1, 81))   # steps 31-40 once, from attempt 2
    spent = [report_source.read_metrics(sweep / "trials" / "a" / f"attempt-{n}")[-1]["cost_usd"] for n in (1, 2)]
    assert spent[1] == summary(sweep / "trials" / "a" / "attempt-2")["cost_usd"]
    assert lines["a"]["cost"] == f"${sum(spent):.2f}"   # the first attempt was paid for too
    assert trial_a.records[-1]["cost_usd"] == pytest.approx(sum(spent))
    assert trial_a.records[29]["cost_usd"] < trial_a.records[30]["cost_usd"]     # no drop to 0 where attempt 2 starts
    assert [(m.step, m.text) for m in trial_a.markers] == [(31, "resumed (attempt-2)")]


@pytest.mark.slow   # matplotlib draws report.png
def test_an_unfinished_run_is_reported_from_its_records(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, [(2, 1, 30)], final=False)

    assert main(["report", str(run)]) == 0
    table = dict(table_rows(capsys.readouterr().out)[1:])
    assert table["steps"] == "30" and table["note"] == "unfinished: no summary.json"
    assert float(table["final loss"]) == pytest.approx(6.0 / 30 ** 0.5, rel=1e-3)
    assert_png(run / "report.png")


def test_a_cpu_run_without_a_price_shows_core_hours_and_no_dollars(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, [(2, 1, 30)])

    assert main(["report", str(run)]) == 0
    table = dict(table_rows(capsys.readouterr().out)[1:])
    assert float(table["device-hours"]) == pytest.approx(summary(run)["device_hours"], rel=1e-3)
    assert "cost" not in table and "cost.prices.cpu_core" in table["priced as"]


def _not_a_dir(tmp_path: Path) -> Path:
    (tmp_path / "file.txt").write_text("x")
    return tmp_path / "file.txt"


def _no_metrics(tmp_path: Path) -> Path:
    (tmp_path / "config.yaml").write_text("train: {}\n")
    return tmp_path


def _metrics(text: str):
    def make(tmp_path: Path) -> Path:
        (tmp_path / "metrics.jsonl").write_text(text)
        return tmp_path / "metrics.jsonl"
    return make


def _empty_sweep(tmp_path: Path) -> Path:
    (tmp_path / "sweep.yaml").write_text("name: s\n")
    (tmp_path / "trials" / "t1").mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize("make, problem", [
    (lambda p: p / "missing", "is not a directory"),
    (_not_a_dir, "is not a directory"),
    (lambda p: p, "neither a run nor a sweep directory"),
    (_no_metrics, "has no metrics.jsonl"),
    (_metrics(""), "is empty"),
    (_metrics('{"step": 1, "loss": 2.0}\n{"step": 2, "lo'), "line 2 is not JSON"),
    (_metrics('{"step": "1", "loss": 2.0}\n'), "line 1 is not a step record"),
    (_empty_sweep, "has no trial with a metrics.jsonl"),
])
def test_bad_input_exits_2_naming_the_path_and_writes_nothing(tmp_path, capsys, make, problem):
    named = make(tmp_path)
    source = named.parent if named.name == "metrics.jsonl" else named

    assert main(["report", str(source)]) == 2
    err = capsys.readouterr().err
    assert problem in err and str(named) in err and "Fix:" in err
    assert not list(tmp_path.rglob("*.png"))


def test_without_matplotlib_the_table_is_printed_and_the_fix_named(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    write_run(run, [(1, 1, 10)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as when the plot extra is not installed

    assert main(["report", str(run)]) == 2
    out, err = capsys.readouterr()
    assert "final loss" in out and 'pip install "raydl[plot]"' in err and not (run / "report.png").exists()


def test_sweep_layout_names_are_the_sweeps_own():
    from raydl.tune import sweep

    assert (report_source.SWEEP_FILE, report_source.TRIALS_DIR) == (sweep.SWEEP_FILE, sweep.TRIALS_DIR)


def test_untrusted_summary_text_prints_on_one_line_without_control_characters(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, [(1, 1, 10)])
    s = summary(run)
    (run / "summary.json").write_text(json.dumps({**s, "precision": "fp32\n\x1b[2Jgone" + "x" * 500, "steps": "ten"}))

    assert main(["report", str(run)]) == 0
    table = dict(table_rows(capsys.readouterr().out)[1:])
    assert table["precision"].startswith("fp32??[2Jgone") and len(table["precision"]) == 120
    assert table["steps"] == "ten" and "\x1b" not in table["precision"]


def test_a_run_in_a_bucket_is_reported_from_its_files_without_its_checkpoints(s3_bucket, tmp_path, capsys):
    """moto's S3 server: only the files a report reads are downloaded; report.png goes back to the bucket."""
    from raydl import storage

    run = tmp_path / "run"
    write_run(run, [(2, 1, 60)])
    (run / "train" / "step_00000060").mkdir(parents=True)
    (run / "train" / "step_00000060" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    fs, path = storage.resolve(f"{s3_bucket}/runs/run", "test")
    storage.upload_dir(str(run), fs, path)
    assert main(["report", f"{s3_bucket}/runs/run"]) == 0
    table = dict(table_rows(capsys.readouterr().out)[1:])
    assert int(table["steps"]) == summary(run)["steps"] == 60
    png = tmp_path / "report.png"
    png.write_bytes(storage.read_bytes(fs, f"{path}/report.png"))
    assert_png(png)
    assert not (run / "report.png").exists()
    with storage.local_copy(f"{s3_bucket}/runs/run", "test", only=report_source.READS) as local:
        assert sorted(p.name for p in Path(local).rglob("*")) == ["metrics.jsonl", "summary.json"]   # no train/
