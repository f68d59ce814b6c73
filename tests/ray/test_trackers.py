"""telemetry.mlflow against a real `mlflow server` (sqlite backend, 127.0.0.1, a free port), telemetry.wandb offline
and telemetry.tensorboard, all three on in one real `raydl train` and one `raydl sweep` on the test Ray: the runs
read back with MlflowClient, from W&B's offline run files and with TensorBoard's reader; `raydl report` after each,
its table against summary.json. The same train run, with a worker failure and restart in it, is priced: summary.json's
device-hours and $ equal the hand computation from the run's own metrics.jsonl and cluster/prices.yaml (one run
for both: each `raydl train` costs ~35 CPU-s of process starts); the sweep's objective is cost_to_target, each trial
priced from its run's summary.json and the cheapest to the target the best."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from raydl import log as raydl_log
from raydl.cli import main
from raydl.telemetry.cost import TABLE_PATH
from raydl.tune.space import parse_sweep
from raydl.tune.sweep import run_sweep
from tests.helpers import not_raydls
from tests.mlflow_server import MlflowServer
from tests.unit.test_report import assert_png, table_rows
from tests.unit.test_tensorboard import assert_events_match_metrics, read_events, texts
from tests.wandb_offline import offline_run

pytestmark = pytest.mark.slow

# Every section the default model on CPU reports into (no GPU readings here).
CPU_TAGS = {"loss/loss", "loss/eval_loss", "optimizer/lr", "optimizer/grad_norm", "throughput/samples_per_s",
            "throughput/tokens_per_s", "time/step_s", "time/data_wait_frac", "memory/peak_memory_mb", "run/world_size"}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with MlflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


CPUS_PER_WORKER = 2


def elapsed(line: dict) -> float:
    """A step's own time and the time before it (eval, report, checkpoint): what the meter charges."""
    return line["between_s"] + line["step_s"]


def core_seconds(lines: list[dict], restart: dict) -> float:
    """Each step at its world size x cores per worker x its elapsed time (steps the failed group reported, then
    redone, included: they were paid for); the restart's gap at the smaller world size."""
    seconds = sum(elapsed(line) * line["world_size"] for line in lines)
    after = max(i for i, line in enumerate(lines) if line["step"] == restart["resumed_at_step"] + 1)   # the new group's
    before, first = lines[after - 1], lines[after]
    gap = first["time"] - elapsed(first) - before["time"]
    return CPUS_PER_WORKER * (seconds + gap * min(before["world_size"], first["world_size"]))


def assert_priced_from_the_table(summary: dict, lines: list[dict]) -> None:
    first_redone = summary["restarts"][0]["resumed_at_step"] + 1
    assert [line["step"] for line in lines].count(first_redone) == 2, "the failed group's record of it, and the new's"
    table = yaml.safe_load(TABLE_PATH.read_text())
    machine = table["machines"]["m5.2xlarge"]
    hours = core_seconds(lines, summary["restarts"][0]) / 3600
    assert summary["device_hours"] == pytest.approx(hours, rel=1e-9)
    assert summary["cost_usd"] == pytest.approx(hours * machine["on_demand"] / machine["vcpus"], rel=1e-9)
    assert lines[-1]["cost_usd"] == pytest.approx(summary["cost_usd"], rel=1e-9)
    assert summary["pricing"]["unit"] == "CPU core" and summary["pricing"]["units_per_worker"] == CPUS_PER_WORKER


def runs_of(uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def test_raydl_train_logs_to_mlflow_wandb_and_tensorboard_and_prices_its_records(ray_session, mlflow_server,
                                                                                 tiny_overrides, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    # Reports every 2 steps and a failure at step 15 (it fires once): steps 11-14 are reported, then redone from
    # the step-10 storage checkpoint.
    (tmp_path / "ledger").mkdir()
    sets = [*tiny_overrides, "telemetry.report_every=2", "train.eval_every=10", "telemetry.tensorboard=true",
            f"telemetry.mlflow.tracking_uri={mlflow_server.uri}", "telemetry.mlflow.experiment=train",
            "telemetry.wandb.project=raydl-test", "telemetry.wandb.mode=offline",
            f"debug.ledger_dir={tmp_path / 'ledger'}", "debug.fail_at_step=15", "checkpoint.memory_every_steps=0",
            f"scaling.cpus_per_worker={CPUS_PER_WORKER}", "cost.instance_type=m5.2xlarge",   # a CPU run priced on it
            "scaling.survivors=off"]   # a restart of the whole group, tagged, logged and priced as one
    assert main(["train", *(arg for s in sets for arg in ("--set", s))]) == 0
    out, err = capsys.readouterr()
    [run_dir] = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and len(summary["restarts"]) == 1
    # One voice on the console: the failure is raydl's line; Ray's lines about it (the worker's traceback) and
    # MLflow's and W&B's own lines are not there, Ray's are in the run's ray.log.
    assert not not_raydls(err) and not not_raydls(out), "\n".join(not_raydls(err) + not_raydls(out))
    assert "[raydl] a worker failed: rank " in err and ": injected failure at step 15" in err, err
    assert "injected failure at step 15" in (run_dir / "ray.log").read_text()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    [run] = runs_of(mlflow_server.uri, "train")
    client = MlflowClient(mlflow_server.uri)
    assert f"logging to MLflow run {run.info.run_id}" in err, err
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "20" and run.data.params["telemetry.report_every"] == "2"
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in loss) == sorted((line["step"], line["loss"]) for line in lines)
    assert run.data.tags["raydl.restarts"] == "1" and "injected failure at step 15" in run.data.tags["raydl.restart.1"]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"summary.json", "report.png"}

    wandb_run = offline_run(run_dir / "wandb")
    assert "logging to W&B run" in err and sorted(wandb_run["history"]) == list(range(1, 21))
    assert wandb_run["config"]["train.max_steps"] == 20 and "restarted" in wandb_run["tags"]

    tags = assert_events_match_metrics(run_dir, run_dir / "tensorboard")
    assert CPU_TAGS <= tags
    events = read_events(run_dir / "tensorboard")
    [(step, restart)] = texts(events, "events/restarts").items()
    assert step == 11 and "injected failure at step 15" in restart and "resumed at step 10" in restart
    assert texts(events, "events/layouts")[1].startswith("2 workers from step 1: dp 2 x pp 1")
    assert_priced_from_the_table(summary, lines)

    assert main(["report", str(run_dir)]) == 0
    table = dict(table_rows(capsys.readouterr().out)[1:])
    assert int(table["steps"]) == 20 and int(table["restarts"]) == 1
    assert float(table["final loss"]) == pytest.approx(summary["final_loss"], rel=1e-3)
    assert_png(run_dir / "report.png")


def assert_each_trial_priced_and_the_cheapest_to_target_best(result: dict) -> None:
    """objective cost_to_target: every trial's cost is what its run's summary.json says it spent, and the best trial
    is the one that reached the target for the fewest dollars (tests/ray/test_cost_sweep.py until 2026-11-29)."""
    rows = result["trials"]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    for r in rows:
        run = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert r["cost_usd"] == pytest.approx(run["cost_usd"]) and run["cost_usd"] > 0
        assert 0 < r["cost_to_target_usd"] <= r["cost_usd"]
    best = min(rows, key=lambda r: r["cost_to_target_usd"])
    assert result["best"] == best["trial"] and result["metric"] == "cost_to_target_usd"
    assert "cost to target" in result["table"] and "$" in result["table"]


def test_a_sweep_logs_a_parent_run_a_child_and_a_tensorboard_directory_per_trial(ray_session, mlflow_server, data_cache,
                                                                                  tmp_path, capsys):
    base = {"run": {"runs_dir": str(tmp_path / "runs")}, "data": {"cache_dir": str(data_cache), "builtin_samples": 4096},
            "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
            "train": {"max_steps": 10, "warmup_steps": 2, "eval_batches": 2},
            "telemetry": {"report_every": 5, "progress": False, "tensorboard": True,
                          "mlflow": {"tracking_uri": mlflow_server.uri, "experiment": "sweep"},
                          "wandb": {"project": "raydl-test", "mode": "offline"}},
            "checkpoint": {"every_steps": 10},
            "cost": {"prices": {"cpu_core": 3600.0}}}          # $1 per core-second: the numbers are readable
    # The sweep of the cost_to_target objective too: a sweep's trials are what it costs, not its objective.
    raydl_log.ensure_configured()   # raydl's console, as `raydl sweep` sets it up (not left to the module's first test)
    result = run_sweep(parse_sweep({"base": base, "space": {"train.lr": [1e-3, 3e-3]},
                                    "objective": "cost_to_target", "target_loss": 3.0}))
    out, err = capsys.readouterr()
    assert_each_trial_priced_and_the_cheapest_to_target_best(result)
    sweep_dir = Path(result["sweep_dir"])
    assert not not_raydls(err), "\n".join(not_raydls(err))   # stdout: the results table
    assert "[raydl] the sweep's MLflow run: http://127.0.0.1:" in err, err

    runs = runs_of(mlflow_server.uri, "sweep")
    [parent] = [r for r in runs if r.data.tags.get("raydl.kind") == "sweep"]
    children = {r.data.tags["raydl.run_key"]: r for r in runs if r is not parent}
    assert sorted(children) == sorted(row["trial"] for row in result["trials"])
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children.values())
    assert parent.info.status == "FINISHED" and parent.data.tags["raydl.best_trial"] == result["best"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    assert {"results.json", "results.png", "best.yaml"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    for row in result["trials"]:
        child = children[row["trial"]]
        assert float(child.data.params["train.lr"]) == row["lr"] and child.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "loss")] == list(range(1, 11))
        wandb_run = offline_run(Path(row["run_dir"]) / "wandb")
        assert wandb_run["id"] == row["trial"] and wandb_run["group"] == sweep_dir.name

    trials = [row["trial"] for row in result["trials"]]
    assert sorted(p.name for p in (sweep_dir / "tensorboard").iterdir()) == sorted(trials)
    for row in result["trials"]:
        assert_events_match_metrics(Path(row["run_dir"]), sweep_dir / "tensorboard" / row["trial"])
    assert main(["report", str(sweep_dir)]) == 0
    header, *lines = table_rows(capsys.readouterr().out)
    assert len(lines) == len(trials) and all(int(dict(zip(header, line))["steps"]) == 10 for line in lines)
    assert_png(sweep_dir / "report.png")
