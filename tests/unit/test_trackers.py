"""telemetry.mlflow / telemetry.wandb: the real metrics writer logs a run with a restart and a resize to MLflow (a
sqlite store, read back with MlflowClient) and to W&B offline (its run file read back); bad settings are one
paragraph and exit 2 before Ray starts. A real `mlflow server`, `raydl train` and `raydl sweep`:
tests/ray/test_trackers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raydl.cli import main
from raydl.metrics import trackers
from raydl.overrides import dump_yaml, load_config
from tests.unit.test_tensorboard import write_run
from tests.wandb_offline import offline_run

GROUPS = [(2, 1, 20), (1, 16, 30)]   # 2 workers to step 20, then 1 worker from the step-15 checkpoint: restart + resize


def tracked_run(run_dir: Path, settings: dict) -> dict:
    """A run directory written through the writer with `settings`' trackers; its metrics.jsonl lines by step."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(load_config(None, ["train.lr=0.0025"])))
    write_run(run_dir, GROUPS, trackers={**settings, "run_key": "run-1", "run_name": run_dir.name, "parent": {}})
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"lines": lines, "last": {line["step"]: line for line in lines}}


@pytest.mark.slow   # ~75 s on a loaded 2-core machine: MLflow's store and report.png
def test_mlflow_gets_config_every_metric_by_step_restarts_and_artifacts(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)   # a sqlite store keeps artifacts in ./mlruns

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    written = tracked_run(tmp_path / "run", {"mlflow": {"tracking_uri": uri, "experiment": "unit"}})
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("unit").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["raydl.run_key"] == "run-1"
    assert run.data.params["train.lr"] == "0.0025" and run.data.params["model.name"] == "gpt"
    loss = client.get_metric_history(run.info.run_id, "loss")
    # Every line of metrics.jsonl, the 5 steps redone after the restart included, at its step.
    assert sorted((m.step, m.value) for m in loss) == sorted((line["step"], line["loss"]) for line in written["lines"])
    for key in ("samples_per_s", "world_size", "eval_loss", "grad_norm", "peak_memory_mb"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history and all(history[s] == pytest.approx(written["last"][s][key]) for s in history), key
    tags = run.data.tags
    assert tags["raydl.restarts"] == "1" and tags["raydl.resizes"] == "1"
    assert "resumed at step 15" in tags["raydl.restart.1"] and tags["raydl.layout.2"].startswith("1 workers from step 16")
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"summary.json", "report.png"}


@pytest.mark.slow   # ~70 s there: wandb's service process and report.png
def test_wandb_offline_gets_config_metrics_tags_and_files(tmp_path):
    written = tracked_run(tmp_path / "run", {"wandb": {"project": "unit", "mode": "offline"}})
    run = offline_run(tmp_path / "run" / "wandb")
    assert run["id"] == "run-1" and run["config"]["train.lr"] == 0.0025
    # W&B keeps only increasing steps: the redone steps 16-20 keep their first values.
    assert sorted(run["history"]) == list(range(1, 31))
    first = {line["step"]: line for line in reversed(written["lines"])}
    assert all(run["history"][s]["loss"] == pytest.approx(first[s]["loss"]) for s in range(1, 31))
    assert {"restarted", "resized"} <= run["tags"] and run["summary"]["raydl.restarts"] == "1"
    assert {"summary.json", "report.png"} <= run["files"]


@pytest.mark.parametrize("sets, words", [
    (["telemetry.mlflow.tracking_uri=ftp://host/x"], "'telemetry.mlflow.tracking_uri' is 'ftp://host/x', whose scheme"),
    (["telemetry.mlflow.experiment=e"], "'telemetry.mlflow.tracking_uri' is missing"),
    (["telemetry.mlflow.tracking_uri=http://h:1", "telemetry.mlflow.run=x"], "'telemetry.mlflow.run' is not a setting"),
    (["telemetry.wandb.project=p", "telemetry.wandb.mode=cloud"], "'telemetry.wandb.mode' is 'cloud', not one of"),
])
def test_bad_tracker_settings_are_one_paragraph_before_ray(tmp_path, capsys, sets, words):
    import ray

    started = ray.is_initialized()
    argv = ["train", "--set", f"run.runs_dir={tmp_path / 'runs'}", *(a for s in sets for a in ("--set", s))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert ray.is_initialized() == started and not (tmp_path / "runs").exists()


def test_a_missing_package_is_named_before_ray(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(Exception, match=r'telemetry.wandb.*pip install "raydl\[wandb\]"'):
        trackers.require_installed(load_config(None, ["telemetry.wandb.project=p"]))


def test_help_lists_the_tracker_fields(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "telemetry.mlflow" in out and "telemetry.wandb" in out


def test_local_stores_are_made_absolute_for_the_writer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert trackers.absolute_store("sqlite:///m.db") == f"sqlite:///{tmp_path}/m.db"
    assert trackers.absolute_store("file:mlruns") == (tmp_path / "mlruns").as_uri()
    assert trackers.absolute_store("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
