"""Experiment trackers of a run (telemetry.mlflow, telemetry.wandb): the records of metrics.jsonl, sent on.

Like the TensorBoard events (raydl.metrics.tensorboard), the metrics writer feeds each tracker the records it
appends to metrics.jsonl, where the run directory is (the metrics sink under Ray, a sweep trial's process, rank
0 under torchrun). A tracker run gets the effective config (<run_dir>/config.yaml, flattened to dotted keys)
as params, every number of a record as a metric at its step, each restart and layout change as a tag, and at
the run's end summary.json and report.png. Its key is the raydl run id (a sweep: the trial id), so a resumed run
or a trial's next attempt logs into the same tracker run. A sweep opens one parent run (`SweepRuns`) whose id
its trials' runs name: MLflow's parent/child runs, W&B's group.

Ray's integrations, read and used where they fit: `setup_wandb` (ray.air.integrations.wandb) opens the W&B run,
here in the writer's process; for MLflow, Ray's `_MLflowLoggerUtil` (what `setup_mlflow` and
`MLflowLoggerCallback` run on) finds or creates the experiment and the run. Not `MLflowLoggerCallback` /
`WandbLoggerCallback` themselves: they log Tune's result of each trial report from the Tune driver, not each
step of metrics.jsonl, and `raydl train` has no Tune driver; nor `setup_mlflow`'s process-wide active run, which
a Tune actor reused for the next trial would carry over. Metrics go to MLflow in one batch per report.

A tracker that fails (its server went away) logs one warning and is dropped: training goes on.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import time
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from raydl import log as raydl_log
from raydl.config import JobConfig
from raydl.errors import ConfigError
from raydl.metrics.tensorboard import layout_text, restart_text, scalars
from raydl.telemetry.records import StepRecord

log = logging.getLogger(__name__)

JOB_KEY = "trackers"          # the job's tracker settings: {"mlflow": {...}, "wandb": {...}, "run_key", "parent"}
SWEEP_FILE = "trackers.json"  # a sweep's parent run ids, for its trials and its --resume
RUN_KEY_TAG = "raydl.run_key"
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}


def require_installed(cfg: JobConfig) -> None:
    """Fail before Ray starts when a tracker is set but its package is not installed."""
    for name, package in PACKAGES.items():
        if getattr(cfg.telemetry, name) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"telemetry.{name}", f"is set but the {package} package is not installed",
                              f'pip install "raydl[{name}]", or leave telemetry.{name} empty')


def job_settings(cfg: JobConfig, *, run_key: str, run_name: str, parent: dict[str, str] | None = None) -> dict:
    """What a writer needs to open the run's trackers (plain data: it travels in the job); {} when none is set."""
    wanted = {name: dict(getattr(cfg.telemetry, name)) for name in PACKAGES if getattr(cfg.telemetry, name)}
    if "mlflow" in wanted:
        wanted["mlflow"]["tracking_uri"] = absolute_store(wanted["mlflow"]["tracking_uri"])
    return {**wanted, "run_key": run_key, "run_name": run_name, "parent": parent or {}} if wanted else {}


def absolute_store(uri: str) -> str:
    """A local store's URI (sqlite:///mlflow.db, file:mlruns) with its path made absolute against this process's
    working directory: the writer runs in another one (a Ray actor's, a Tune trial's)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme == "sqlite" and uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    if parts.scheme == "file" and not parts.netloc and not parts.path.startswith("/"):
        return Path(parts.path).resolve().as_uri()
    return uri


def settings_for(cfg: JobConfig, job: dict[str, Any]) -> dict:
    """The job's tracker settings: those a caller (a sweep trial) put in it, else the run's own (keyed by its run id)."""
    return job.get(JOB_KEY) or job_settings(cfg, run_key=job["run_id"], run_name=Path(job["run_dir"]).name)


def flat_config(run_dir: Path) -> dict[str, Any]:
    """The run's effective config as {"section.key": value}: model.options and cost.prices one level deeper."""
    def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                out.update(flatten(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out
    return flatten(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})


def open_trackers(settings: dict, run_dir: Path) -> list:
    """The trackers `settings` (job_settings) asks for, opened; one that cannot be opened is warned about and left out."""
    trackers = []
    for name, cls in (("mlflow", MlflowTracker), ("wandb", WandbTracker)):
        if name in settings:
            try:
                trackers.append(cls(settings[name], run_dir, settings))
            except Exception as e:   # a tracker is a copy of metrics.jsonl: never a reason to stop training
                log.warning(f"telemetry.{name}: cannot open a run ({type(e).__name__}: {e}); not logging to it")
    return trackers


def report_png(run_dir: Path) -> Path | None:
    """report.png of the run (raydl report's figure), when matplotlib is installed."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from raydl.report import load, write_png

    try:
        return write_png(load(run_dir))
    except Exception as e:   # the trackers still get summary.json
        log.warning(f"cannot draw report.png for the experiment trackers ({type(e).__name__}: {str(e)[:300]})")
        return None


def run_where(uri: str, experiment_id: str, run_id: str) -> str:
    """Where to see an MLflow run: its page, as MLflow prints it ("View run ... at: URL"), for a tracking server;
    the store's URI for a local store (no UI of its own)."""
    if urllib.parse.urlsplit(uri).scheme in ("http", "https"):
        return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return uri


def quiet_mlflow_urls() -> None:
    """MLflow prints "🏃 View run ... at: URL" and "🧪 View experiment ..." to stdout when a run on a tracking
    server ends; raydl says where the run is in its own line instead (with -v MLflow's lines show too)."""
    if raydl_log.current_verbosity() < raydl_log.VERBOSE:
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


def tags_of(restarts: list[dict[str, Any]], layouts: list[dict[str, Any]]) -> dict[str, str]:
    """Restarts and layout changes (resizes among them) as tags: raydl.restart.N, raydl.layout.N, and counts."""
    tags = {f"raydl.restart.{i}": restart_text(r) for i, r in enumerate(restarts, 1)}
    tags.update({f"raydl.layout.{i}": layout_text(layout) for i, layout in enumerate(layouts, 1)})
    sizes = [layout["world_size"] for layout in layouts]
    resizes = sum(a != b for a, b in zip(sizes, sizes[1:]))
    return {**tags, "raydl.restarts": str(len(restarts)), "raydl.resizes": str(resizes)}


class MlflowTracker:
    def __init__(self, settings: dict[str, str], run_dir: Path, job: dict):
        from mlflow.entities import Param
        from ray.air._internal.mlflow import _MLflowLoggerUtil

        # Its INFO lines (a sqlite store's table creation) would reach the driver with this process's Ray prefix.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        self.util = _MLflowLoggerUtil()
        self.util.setup_mlflow(tracking_uri=settings["tracking_uri"],
                               experiment_name=settings.get("experiment", "raydl"),
                               create_experiment_if_not_exists=True)
        self.client = self.util._get_client()
        self.tags_written: dict[str, str] = {}
        key = job["run_key"]
        found = self.client.search_runs([self.util.experiment_id], f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=1)
        if found:   # a resumed run or a trial's next attempt: the same MLflow run, its params already logged
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.where = (f"MLflow run {self.run_id} (continued): "
                          f"{run_where(settings['tracking_uri'], self.util.experiment_id, self.run_id)}")
            return
        tags = {RUN_KEY_TAG: key, **({"mlflow.parentRunId": job["parent"]["mlflow"]} if "mlflow" in job["parent"] else {})}
        self.run_id = self.util.start_run(run_name=job["run_name"], tags=tags).info.run_id
        self.where = (f"MLflow run {self.run_id} in experiment {settings.get('experiment', 'raydl')}: "
                      f"{run_where(settings['tracking_uri'], self.util.experiment_id, self.run_id)}")
        params = [Param(k, str(v)[:6000]) for k, v in flat_config(run_dir).items()]
        for i in range(0, len(params), 100):   # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def write(self, records: list[StepRecord], *, restarts: list[dict[str, Any]], layouts: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric, RunTag

        metrics = [Metric(name.split("/", 1)[1], value, int(r.time * 1000), r.step)
                   for r in records for name, value in scalars(r.to_dict()).items()]
        tags = {k: v for k, v in tags_of(restarts, layouts).items() if self.tags_written.get(k) != v}
        for i in range(0, len(metrics), 1000):   # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000],
                                  tags=[RunTag(k, v) for k, v in tags.items()] if i == 0 else [])
        if not metrics and tags:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        self.tags_written.update(tags)

    def finish(self, run_dir: Path, png: Path | None) -> None:
        self.client.log_artifact(self.run_id, str(run_dir / "summary.json"))
        if png:
            self.client.log_artifact(self.run_id, str(png))
        self.client.set_terminated(self.run_id, status="FINISHED")

    def fail(self) -> None:
        self.client.set_terminated(self.run_id, status="FAILED")


class WandbTracker:
    def __init__(self, settings: dict[str, str], run_dir: Path, job: dict):
        from ray.air.integrations.wandb import setup_wandb

        # W&B run ids: letters, digits, - and _ (a sweep trial's id is one already).
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", job["run_key"])
        # setup_wandb asks for an API key unless WANDB_MODE says offline; W&B's own console lines would reach the
        # driver with this process's Ray prefix: raydl says where the run is instead (`where`).
        os.environ["WANDB_MODE"] = settings.get("mode", "online")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = setup_wandb(flat_config(run_dir), rank_zero_only=False, project=settings["project"],
                               entity=settings.get("entity"), mode=settings.get("mode", "online"),
                               trial_id=run_id, trial_name=job["run_name"], group=job["parent"].get("wandb"),
                               dir=str(run_dir), resume="allow")
        self.last_step = self.run.step or 0   # a resumed run's history goes on from there
        self.tags_written: dict[str, str] = {}
        self.where = (f"W&B run {run_id} (offline, in {self.run.dir.rsplit('/files', 1)[0]}; upload it with `wandb sync`)"
                      if self.run.offline else f"W&B run {self.run.url}")

    def write(self, records: list[StepRecord], *, restarts: list[dict[str, Any]], layouts: list[dict[str, Any]]) -> None:
        for r in records:
            # W&B keeps one value per step and only increasing steps: steps redone after a restart are dropped
            # here (their first values stay), where metrics.jsonl and MLflow keep both.
            if r.step > self.last_step:
                self.run.log({name.split("/", 1)[1]: value for name, value in scalars(r.to_dict()).items()}, step=r.step)
                self.last_step = r.step
        tags = tags_of(restarts, layouts)
        if tags != self.tags_written:
            self.run.summary.update(tags)
            labels = {"restarted"} if restarts else set()
            labels |= {"resized"} if int(tags["raydl.resizes"]) else set()
            self.run.tags = tuple(sorted(set(self.run.tags or ()) | labels))
            self.tags_written = tags

    def finish(self, run_dir: Path, png: Path | None) -> None:
        for path in [run_dir / "summary.json", *([png] if png else [])]:
            self.run.save(str(path), base_path=str(run_dir), policy="now")
        self.run.summary.update({f"summary/{k}": v for k, v in json.loads((run_dir / "summary.json").read_text()).items()
                                 if isinstance(v, (int, float, str)) and not isinstance(v, bool)})
        self.run.finish()
        import wandb

        # Its service process, stopped now: at this process's exit (Ray ends a sink actor with a signal) wandb's
        # own atexit hook found the connection gone and printed a traceback.
        wandb.teardown()

    def fail(self) -> None:
        import wandb

        self.run.finish(exit_code=1)
        wandb.teardown()


def send(trackers: list, method: str, *args, **kwargs) -> list:
    """Call `method` on each tracker; one that raises is warned about once and dropped (the rest go on)."""
    kept = []
    for tracker in trackers:
        try:
            getattr(tracker, method)(*args, **kwargs)
            kept.append(tracker)
        except Exception as e:   # its server went away: metrics.jsonl still has it all
            name = "mlflow" if isinstance(tracker, MlflowTracker) else "wandb"
            log.warning(f"telemetry.{name}: {type(e).__name__}: {str(e)[:300]}; no longer logging this run to it")
    return kept


class SweepRuns:
    """A sweep's parent runs: an MLflow run (its trials' runs are its children) and a W&B group name. Their ids are
    kept in <sweep_dir>/trackers.json, which the trials and `raydl sweep --resume` read."""

    @staticmethod
    def start(cfg: JobConfig, sweep_dir: Path, params: dict[str, Any]) -> dict[str, str]:
        parent: dict[str, str] = {}
        if cfg.telemetry.wandb:
            parent["wandb"] = sweep_dir.name
        if cfg.telemetry.mlflow:
            from ray.air._internal.mlflow import _MLflowLoggerUtil

            util = _MLflowLoggerUtil()
            util.setup_mlflow(tracking_uri=cfg.telemetry.mlflow["tracking_uri"],
                              experiment_name=cfg.telemetry.mlflow.get("experiment", "raydl"),
                              create_experiment_if_not_exists=True)
            run = util.start_run(run_name=sweep_dir.name, tags={RUN_KEY_TAG: str(sweep_dir), "raydl.kind": "sweep"})
            util.log_params({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in params.items()},
                            run_id=run.info.run_id)
            parent["mlflow"] = run.info.run_id
        (sweep_dir / SWEEP_FILE).write_text(json.dumps(parent))
        return parent

    @staticmethod
    def read(sweep_dir: Path) -> dict[str, str]:
        path = sweep_dir / SWEEP_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    @staticmethod
    def finish(cfg: JobConfig, sweep_dir: Path, best: str | None, files: list[Path]) -> None:
        """The parent MLflow run: the sweep's results as artifacts, its best trial as a tag, ended."""
        run_id = SweepRuns.read(sweep_dir).get("mlflow")
        if not run_id:
            return
        from mlflow.tracking import MlflowClient

        uri = cfg.telemetry.mlflow["tracking_uri"]
        client = MlflowClient(tracking_uri=uri)
        for path in files:
            if path.exists():
                client.log_artifact(run_id, str(path))
        client.set_tag(run_id, "raydl.best_trial", best or "none")
        quiet_mlflow_urls()
        client.set_terminated(run_id, status="FINISHED", end_time=int(time.time() * 1000))
        log.info(f"the sweep's MLflow run: {run_where(uri, client.get_run(run_id).info.experiment_id, run_id)}")
