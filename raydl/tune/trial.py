"""The Tune trainable of `raydl sweep`, on the trial's actor: one raydl training run per trial, each attempt in
trials/<trial_id>/attempt-N/, attempt N+1 resuming from N's checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raydl import log as raydl_log
from raydl.metrics import tensorboard, trackers
from raydl.overrides import apply_overrides, build_config
from raydl.train import checkpoint as ckpt
from raydl.tune import mirror as sweep_mirror
from raydl.tune import report
from raydl.tune.space import parse_sweep, trains_in_trial, trial_tree
from raydl.tune.trial_session import InTrialSession, TrialMetrics, TrialReporter

TRIALS_DIR = "trials"


def attempts_of(trial_dir: Path) -> list[Path]:
    return sorted(trial_dir.glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))


def trial_history(trial_dir: Path) -> list[dict[str, Any]]:
    return report.stitch([report.read_records(a) for a in attempts_of(trial_dir)])


def run_trial(params: dict[str, Any], *, sweep: dict[str, Any], sweep_dir: str, mirror: str | None = None, model=None,
              import_dir: str = "") -> None:
    """The Tune trainable: one raydl training run; a rerun after Tuner.restore continues from the last checkpoint.
    `mirror`: the sweep's place in a bucket (raydl.tune.mirror), or None. `model`: the ModelSpec object of
    raydl.sweep(model=...), or None for model.name's, which is imported from `import_dir` (the sweep driver's
    working directory; Tune runs trials in their own)."""
    from ray import tune

    from raydl.driver.prepare import prepare_run
    from raydl.driver.run_location import checkpoints_location
    from raydl.models.registry import search_from

    raydl_log.configure()   # the driver's verbosity, from RAYDL_VERBOSITY in the runtime env
    raydl_log.quiet_exits_in_callbacks()   # Tune ends this actor with SIGTERM
    search_from(import_dir)
    spec = parse_sweep(sweep)
    trial_id = tune.get_context().get_trial_id()
    if mirror:   # its earlier attempts may have run on another node
        sweep_mirror.pull(mirror, Path(sweep_dir), TRIALS_DIR, trial_id)
    trial_dir = Path(sweep_dir) / TRIALS_DIR / trial_id
    attempts = attempts_of(trial_dir)
    # An attempt's checkpoints are in its directory, or where the sweep's checkpoint.storage_path (a bucket) put them.
    latest = (ckpt.find_latest(checkpoints_location(str(a))) for a in reversed(attempts))
    resume_from = next((c for c in latest if c), None)
    resumed_step = ckpt.read_state(resume_from)["step"] if resume_from else 0
    overrides = {"run.dir": str(trial_dir / f"attempt-{len(attempts) + 1}"), "scaling.max_failures": 0,
                 **({"checkpoint.storage_path": sweep_mirror.trial_checkpoints(mirror, trial_id)} if mirror else {})}
    tree = apply_overrides(trial_tree(spec, params), overrides)
    run = prepare_run(build_config(tree), resume=str(resume_from) if resume_from else None, model=model)
    run.job[tensorboard.JOB_KEY] = str(Path(sweep_dir) / tensorboard.EVENTS_DIR / trial_dir.name)   # attempts append
    run.job[trackers.JOB_KEY] = trackers.job_settings(run.cfg, run_key=trial_dir.name, run_name=trial_dir.name,
                                                      parent=trackers.SweepRuns.read(Path(sweep_dir)))   # attempts too
    prior = report.stitch([report.read_records(a) for a in attempts], upto_step=resumed_step)
    metrics = TrialMetrics(target=spec.target_loss, target_metric=spec.target_metric, records=prior)
    try:
        train(run, metrics)   # raises on any failure -> trial ERROR
    finally:
        if mirror:
            sweep_mirror.push_attempt(run.run_dir, mirror, trial_id)


def train(run, metrics: TrialMetrics) -> None:
    """One attempt of a trial: in this process for one worker, else through a Ray Train controller."""
    if trains_in_trial(run.cfg):
        from raydl.train.loop import train_worker

        train_worker(run.job, InTrialSession(str(run.run_dir), run.job["run_id"], run.cfg,
                                             tensorboard.events_dir(run.cfg, run.job),
                                             trackers.settings_for(run.cfg, run.job), metrics))
        return
    from raydl.driver.ray_trainer import build_trainer

    run.job["tune_reports"] = True   # Tune sees a multi-worker trial only through its Train reports
    build_trainer(run, callbacks=[TrialReporter(metrics)]).fit()
