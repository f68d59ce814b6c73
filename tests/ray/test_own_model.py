"""A user's own model on a real local Ray: by import path from a file in the test's directory, through
`raydl.train` and in a sweep (through `raydl train`, in a pipeline: tests/ray/test_console.py's quiet run), and the
two examples/ as docs/own-model.md runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import raydl
from raydl.cli import main

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "tests" / "assets" / "own_net.py"


@pytest.fixture
def own_model_dir(tmp_path, monkeypatch):
    """mymodels/net.py in a fresh directory that is the working directory, as a user would have it."""
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "net.py").write_text(ASSET.read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("mymodels.net", None)
    sys.modules.pop("mymodels", None)


def _sets(tmp_path: Path, data_cache: Path, steps: int) -> list[str]:
    return [f"data.cache_dir={data_cache}", f"run.runs_dir={tmp_path / 'runs'}", f"train.max_steps={steps}",
            "data.builtin_samples=4096", "train.warmup_steps=5", "train.lr=0.003",   # a short run's lr
            "telemetry.report_every=10",
            f"checkpoint.every_steps={steps}", "train.eval_batches=2", "telemetry.progress=false"]


def _printed_summary(out: str) -> dict:
    """The summary `raydl train` prints on stdout (its progress lines go to stderr)."""
    return json.loads(out[out.find("\n{\n") + 1:])   # stdout carries the summary alone, or after other output


def losses_of(run_dir: str | Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def loss_fell(losses: list[float]) -> bool:
    """The mean loss of the last 5 steps well below that of the first 5."""
    return sum(losses[-5:]) < 0.85 * sum(losses[:5])


@pytest.mark.slow
def test_import_path_model_trains_through_raydl_train(ray_session, own_model_dir, data_cache):
    summary = raydl.train(overrides=_sets(own_model_dir, data_cache, 40) + ["model.name=mymodels.net:make_spec"])
    assert summary["layouts"][0]["dp"] == 2 and summary["checkpoint"].endswith("step_00000040")
    assert loss_fell(losses_of(summary["run_dir"])), losses_of(summary["run_dir"])


@pytest.mark.slow
def test_examples_mlp_classifier_by_import_path(ray_session, data_cache, tmp_path, monkeypatch, capsys):
    """docs/own-model.md's first command as printed there (which marks it `tested by` this test), from the checkout,
    with the test's data cache, runs directory, a smaller built-in dataset and a shorter evaluation."""
    monkeypatch.chdir(REPO)   # the guide runs it from the checkout
    command = ["train", "--set", "model.name=examples.mlp_classifier:spec", "--set", "model.options.hidden=256",
               "--set", "parallel.pp_degree=2", "--set", "train.max_steps=80"]
    sets = [f"data.cache_dir={data_cache}", f"run.runs_dir={tmp_path / 'runs'}", "data.builtin_samples=4096",
            "train.eval_batches=2", "telemetry.progress=false"]
    assert main([*command, *(a for s in sets for a in ("--set", s))]) == 0
    summary = _printed_summary(capsys.readouterr().out)
    assert loss_fell(losses_of(summary["run_dir"])) and summary["eval"]["accuracy"] is not None
    assert summary["steps"] == 80 and summary["layouts"][0]["pp"] == 2


@pytest.mark.slow
def test_examples_train_from_python_script(data_cache, tmp_path, on_shared_ray):
    """Its own process, on the session's Ray (RAY_ADDRESS): the inline spec travels to the workers pickled by value."""
    sets = [f"data.cache_dir={data_cache}", "data.builtin_samples=4096", "train.eval_batches=2", "train.warmup_steps=5",
            "train.lr=0.003"]
    done = subprocess.run([sys.executable, "examples/train_from_python.py", "--steps", "40", "--runs-dir",
                           str(tmp_path / "runs"), *(a for s in sets for a in ("--set", s))],
                          cwd=REPO, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert loss_fell(losses_of(result["run_dir"]))


@pytest.mark.slow
def test_import_path_model_in_a_sweep(ray_session, own_model_dir, data_cache):
    """Tune runs each trial in its own directory and process: model.name still imports there."""
    base = {"model": {"name": "mymodels.net:make_spec"}, "run": {"runs_dir": str(own_model_dir / "runs")},
            "data": {"cache_dir": str(data_cache), "builtin_samples": 4096},
            "scaling": {"min_workers": 1, "max_workers": 1},
            "train": {"max_steps": 10, "warmup_steps": 2, "eval_batches": 2},
            "telemetry": {"report_every": 5, "progress": False}, "checkpoint": {"every_steps": 10}}
    summary = raydl.sweep({"base": base, "space": {"train.lr": [0.003, 0.01]}, "objective": "eval_loss"})
    assert [r["status"] for r in summary["trials"]] == ["ok", "ok"], summary["trials"]
    assert [r["steps"] for r in summary["trials"]] == [10, 10] and all(r["eval_loss"] for r in summary["trials"])
