"""`raydl sweep`: Ray Tune runs one full raydl training run per trial and reports which setting trains fastest.

    raydl sweep                                   # default: batch sizes x {fp32, bf16 (+fp16 on GPU)}
    raydl sweep --config sweep.yaml --address auto
    raydl sweep --resume runs/sweep-20260101-120000

A trial is a Tune function trainable: trial values -> `apply_overrides` -> `build_config` ->
`prepare_run`, the code path of `raydl train`. A 1-worker trial then trains in its own process
(raydl.tune.trial_session), and Tune keeps its actor, imports and all, for the next trial; a larger
one is a Ray Train *driver* (`build_trainer(...).fit()`). Either way `max_failures=0`: a failure
ends the trial (recorded as infeasible, with its reason) instead of retrying. Layout of a sweep directory:

    sweep.yaml                      the sweep as parsed (what --resume reads back)
    tune/                           the Tune experiment (Tuner.restore reads it)
    trials/<trial_id>/attempt-N/    raydl run directories; attempt N+1 resumes from N's checkpoint (workers.log:
                                    the tracebacks of its workers' errors; Tune's tune/<trial_id>/error.txt: the trial's)
    tensorboard/<trial_id>/         TensorBoard events of all a trial's attempts (telemetry.tensorboard)
    trial_starts.jsonl              when the sweep and each trial started (the report's start times)
    results.csv results.json results.png best.yaml
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from raydl import commands
from raydl import log as raydl_log
from raydl import storage
from raydl.metrics import tensorboard, trackers
from raydl.errors import ClusterLost, ConfigError, one_line
from raydl.overrides import apply_overrides, build_config
from raydl.parallel import float8
from raydl.telemetry.cost import CPU, Pricing
from raydl.tune import mirror as sweep_mirror
from raydl.tune import report
from raydl.tune.progress import (COMPLETED_FILE, STARTS_FILE, TUNE_DIR, Progress, QuietRaydlTrialErrors,
                                 note_start, read_starts)
from raydl.tune.space import (SweepSpec, parse_sweep, probe_points, trial_config, trial_cpus_gpus,
                              trial_resources)
from raydl.tune.trial import TRIALS_DIR, attempts_of, run_trial, trial_history

SWEEP_FILE = "sweep.yaml"
REPORT_FILES = ("results.csv", "results.json", "results.png", "best.yaml")

log = logging.getLogger(__name__)


def max_concurrent(spec: SweepSpec, cluster: dict[str, float], *, use_gpu: bool) -> int:
    """Trials that fit the cluster at once (space.trial_cpus_gpus), capped by the spec."""
    cpus, gpus = trial_cpus_gpus(spec, use_gpu)
    have_cpu, have_gpu = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    if cpus > have_cpu:
        raise ConfigError("scaling.max_workers", f"gives trials that need {cpus:g} CPUs (the workers' "
                          f"scaling.cpus_per_worker, +1 for the Train driver of a multi-worker trial) but the "
                          f"cluster has {have_cpu:g}",
                          "lower base scaling.max_workers or scaling.cpus_per_worker, or use --address for a "
                          "bigger cluster")
    fit = int(have_cpu // cpus)
    if gpus:
        if gpus > have_gpu:
            raise ConfigError("scaling.gpus_per_worker", f"gives trials that need {gpus:g} GPUs but the cluster "
                              f"has {have_gpu:g}", "lower scaling.max_workers or scaling.gpus_per_worker")
        fit = min(fit, int(have_gpu // gpus))
    return min(fit, spec.max_concurrent_trials or fit)


def _asha(spec: SweepSpec):
    from ray.tune.schedulers import ASHAScheduler

    if spec.asha is None:
        return None
    budget = spec.budget()
    metric = "eval_loss" if spec.base_config().train.eval_every else "loss"
    # No rung at the end of the budget and no stop at max_t: a trial that has seen all its samples ends by
    # itself with its final report; stopped there by ASHA it would lose that report and count as stopped.
    return ASHAScheduler(time_attr="samples", metric=metric, mode="min", max_t=budget - 1,
                         grace_period=spec.asha.grace(budget),
                         reduction_factor=spec.asha.reduction_factor, stop_last_trials=False)


def _absolute_paths(base: dict[str, Any]) -> dict[str, Any]:
    """Tune runs trials in their own working directory: make the base config's local paths absolute."""
    data = base.get("data") or {}
    fixed = {f"data.{k}": str(Path(data[k]).resolve()) for k in ("cache_dir", "path")
             if data.get(k) and data[k] != "builtin" and "://" not in str(data[k])}
    if "cache_dir" not in data:
        fixed["data.cache_dir"] = str(Path(build_config({}).data.cache_dir).resolve())
    return apply_overrides(base, fixed)


def prepare_data(spec: SweepSpec, model=None) -> None:
    """Check every probed trial's model options, and check (for 'builtin', generate once) every dataset the trials
    use, before any trial starts."""
    from raydl.models.choice import choose_model
    from raydl.tune.space import probe_points, trial_errors

    configs = [(params, trial_config(spec, params)) for params in probe_points(spec)]
    choices = []
    for params, cfg in configs:   # every trial's options first (a searched model.options entry), then the data
        with trial_errors(f"trial {params}"):
            choices.append(choose_model(cfg.model, model))
    seen = set()
    for (_, cfg), choice in zip(configs, choices):
        key = (cfg.model.name, json.dumps(cfg.data.__dict__, sort_keys=True, default=str), cfg.train.seed)
        if key not in seen:
            seen.add(key)
            choice.open_dataset(cfg)


def require_price(spec: SweepSpec, *, gpu: bool) -> None:
    """The cost_to_target objective needs $: a CPU run has a price only where the base config gives one (whether
    trials run on GPUs is known once Ray is up, still before any trial starts)."""
    if spec.objective != "cost_to_target" or gpu:
        return
    rate = Pricing.for_config(spec.base_config()).rate(CPU)
    if rate.usd_per_unit_hour is None:
        raise ConfigError("objective", f"is cost_to_target, but the trials run on CPUs with no price ({rate.priced_as})",
                          "set base cost.prices.cpu_core: <$ per core-hour> or cost.instance_type: <machine>, or "
                          "use objective: time_to_target")


def new_sweep_dir(spec: SweepSpec) -> Path:
    base = spec.base_config()
    sweep_dir = (Path(base.run.runs_dir) / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    sweep_dir.mkdir(parents=True, exist_ok=False)
    return sweep_dir


def _trainable(spec: SweepSpec, sweep_dir: Path, mirror: str | None, model):
    from ray import tune

    from raydl.driver.ray_trainer import use_gpu

    gpu = use_gpu(spec.base_config())
    with_data = tune.with_parameters(run_trial, sweep=spec.to_dict(), sweep_dir=str(sweep_dir), mirror=mirror,
                                     model=model, import_dir=os.getcwd())
    return tune.with_resources(with_data, lambda params: trial_resources(trial_config(spec, params), gpu))


def _tuner(spec: SweepSpec, sweep_dir: Path, mirror: str | None, concurrency: int, model):
    from ray import tune

    return tune.Tuner(
        _trainable(spec, sweep_dir, mirror, model),
        param_space={d.path: d.tune_domain() for d in spec.space.values()},
        # reuse_actors: the next trial of the same resources starts in a finished trial's process, its imports done.
        tune_config=tune.TuneConfig(num_samples=spec.num_samples, max_concurrent_trials=concurrency,
                                    scheduler=_asha(spec), trial_dirname_creator=lambda t: t.trial_id,
                                    reuse_actors=True),
        run_config=tune.RunConfig(name=TUNE_DIR, storage_path=mirror or str(sweep_dir), verbose=2 if _verbose() else 0,
                                  callbacks=[Progress(sweep_dir)]),
    )


def check_fp8(spec: SweepSpec, *, workers_on_gpu: bool | None, local: bool) -> None:
    """A sweep with fp8 among its precisions runs only where its workers' GPUs can (raydl.parallel.float8)."""
    if any(trial_config(spec, params).train.precision == "fp8" for params in probe_points(spec)):
        float8.check_before_start("fp8", workers_on_gpu=workers_on_gpu, local=local)


def run_sweep(spec: SweepSpec, *, address: str | None = None, model=None) -> dict[str, Any]:
    """Start a sweep: check data and resources, write sweep.yaml, run all trials, write the report.
    `model`: a ModelSpec object every trial trains instead of model.name's (raydl.sweep(model=...))."""
    from raydl.driver.ray_trainer import connect, ray_env, use_gpu

    spec = dataclasses.replace(spec, base=_absolute_paths(spec.base))
    tensorboard.require_installed(spec.base_config())
    trackers.require_installed(spec.base_config())
    check_fp8(spec, workers_on_gpu=False if spec.base_config().scaling.use_gpu == "false" else None,
              local=address is None)
    prepare_data(spec, model)
    started_ray = connect(address, ray_env(spec.base_config()))
    import ray

    require_price(spec, gpu=use_gpu(spec.base_config()))
    check_fp8(spec, workers_on_gpu=use_gpu(spec.base_config()), local=False)
    concurrency = max_concurrent(spec, ray.cluster_resources(), use_gpu=use_gpu(spec.base_config()))
    sweep_dir = new_sweep_dir(spec)
    mirror = sweep_mirror.location(spec.base_config(), sweep_dir.name)
    (sweep_dir / SWEEP_FILE).write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
    if mirror:
        sweep_mirror.push_file(sweep_dir / SWEEP_FILE, mirror)
    trackers.SweepRuns.start(spec.base_config(), sweep_dir, {"objective": spec.objective, "num_trials": num_trials(spec),
                                                             **{f"space.{k}": v for k, v in spec.to_dict()["space"].items()}})
    log.info(f"sweep directory: {sweep_dir}{f', kept in {mirror}' if mirror else ''} ({num_trials(spec)} trials, "
             f"{concurrency} at a time)")
    return _finish(spec, sweep_dir, mirror, _tuner(spec, sweep_dir, mirror, concurrency, model), address=address,
                   started_ray=started_ray)


def resume_sweep(sweep_dir: str | Path, *, address: str | None = None, model=None) -> dict[str, Any]:
    """Continue an interrupted sweep: finished and failed trials are kept, unfinished ones resume from checkpoints."""
    from ray import tune

    from raydl.driver.ray_trainer import connect, ray_env

    given = str(sweep_dir)
    sweep_dir, mirror = _from_bucket(given) if storage.is_uri(given) else (Path(given).resolve(), None)
    spec = parse_sweep(yaml.safe_load((sweep_dir / SWEEP_FILE).read_text())) if (sweep_dir / SWEEP_FILE).is_file() \
        else None
    mirror = mirror or (sweep_mirror.location(spec.base_config(), sweep_dir.name) if spec else None)
    experiment = storage.join(mirror, TUNE_DIR) if mirror else str(sweep_dir / TUNE_DIR)
    if spec is None or not tune.Tuner.can_restore(experiment):
        raise ConfigError("--resume", f"'{given}' is not a sweep directory (needs {SWEEP_FILE} and {TUNE_DIR}/)",
                          "pass the directory that `raydl sweep` printed as 'sweep directory', or the bucket "
                          "location it printed after 'kept in'")
    started_ray = connect(address, ray_env(spec.base_config()))
    log.info(f"resuming sweep {sweep_dir}")
    tuner = tune.Tuner.restore(experiment, trainable=_trainable(spec, sweep_dir, mirror, model),
                               resume_unfinished=True, resume_errored=False)
    return _finish(spec, sweep_dir, mirror, tuner, address=address, started_ray=started_ray)


def _from_bucket(mirror: str) -> tuple[Path, str]:
    """(the local sweep directory, rebuilt from the bucket's files where it is missing, the bucket location):
    for a sweep whose driver's node, and its disk, are gone."""
    storage.check(mirror, "--resume")
    with storage.local_copy(mirror, "--resume", only=(SWEEP_FILE,)) as scratch:
        found = Path(scratch) / SWEEP_FILE
        if not found.is_file():
            raise ConfigError("--resume", f"'{mirror}' holds no {SWEEP_FILE}, so it is not a sweep kept in a bucket",
                              "pass the location `raydl sweep` printed after 'kept in'")
        spec = parse_sweep(yaml.safe_load(found.read_text()))
    sweep_dir = (Path(spec.base_config().run.runs_dir) / mirror.rstrip("/").rsplit("/", 1)[1]).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    sweep_mirror.pull(mirror, sweep_dir, only=(SWEEP_FILE, STARTS_FILE, COMPLETED_FILE))
    return sweep_dir, mirror


def num_trials(spec: SweepSpec) -> int:
    grid = math.prod(len(d.values) for d in spec.space.values() if d.kind == "grid")
    return grid * spec.num_samples


@contextmanager
def _tune_env():
    """Env vars that Tune reads in the driver while it runs the sweep.

    TUNE_DISABLE_STRICT_METRIC_CHECKING: trial results leave out metrics not known yet (report.trial_metrics).
    ASHA skips such a result (async_hyperband.py::on_trial_result); Tune's strict check would stop the sweep.
    RAY_AIR_NEW_OUTPUT=0 unless -v: Tune's newer console output prints an experiment box and paths even at
    verbose=0 (tune/experimental/output.py); the older one prints nothing there. With -v Tune's tables show.
    Also, unless -v, the tracebacks of trials that failed with a RaydlError stay off the console (QuietRaydlTrialErrors),
    and so do Tune's own lines on Ctrl-C."""
    wanted = {"TUNE_DISABLE_STRICT_METRIC_CHECKING": "1", **({} if _verbose() else {"RAY_AIR_NEW_OUTPUT": "0"})}
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    quiet, controller_log = QuietRaydlTrialErrors(), logging.getLogger("ray.tune.execution.tune_controller")
    # Tune's own Ctrl-C lines ("Stop signal received ...", "Resume experiment with: Tuner.restore(...)"): raydl says
    # the sweep was interrupted and prints its own `raydl sweep --resume` command.
    tune_log = logging.getLogger("ray.tune.tune")
    tune_level = tune_log.level
    if not _verbose():
        controller_log.addFilter(quiet)
        tune_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        controller_log.removeFilter(quiet)
        tune_log.setLevel(tune_level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def _verbose() -> bool:
    return raydl_log.current_verbosity() >= raydl_log.VERBOSE


def _finish(spec: SweepSpec, sweep_dir: Path, mirror: str | None, tuner, *, address: str | None,
            started_ray: bool) -> dict[str, Any]:
    """Run the trials; Ray's own console lines go to <sweep_dir>/ray.log meanwhile (raydl.driver.ray_output).
    `address`: the cluster the sweep runs on, which its printed commands name. `started_ray`: connect started this
    process's Ray, whose lines stay routed there until the process exits."""
    from ray.exceptions import RayActorError, RaySystemError

    from raydl.driver.ray_output import RAY_LOG, route_to

    t0 = time.time()
    note_start(sweep_dir)
    try:
        with _tune_env(), route_to(sweep_dir / RAY_LOG, keep_after=started_ray):
            grid = tuner.fit()
    except (RayActorError, RaySystemError, ConnectionError) as e:   # Tune's own actors are gone with the cluster
        raise ClusterLost(f"the Ray cluster of sweep {sweep_dir} went away ({one_line(e)[:300]}). Finished trials and "
                          f"their checkpoints are in {mirror or sweep_dir}. Fix: bring the cluster back and continue "
                          f"with `{commands.resume_sweep(sweep_dir)}`.") from None
    finally:
        for name in (STARTS_FILE, COMPLETED_FILE) if mirror else ():
            sweep_mirror.push_file(sweep_dir / name, mirror)
    if mirror:   # the attempts, from whichever node ran them
        sweep_mirror.pull(mirror, sweep_dir, TRIALS_DIR)
    completed_file = sweep_dir / COMPLETED_FILE
    completed = set(completed_file.read_text().split()) if completed_file.exists() else set()
    starts = read_starts(sweep_dir)
    rows = sorted((trial_row(spec, sweep_dir, r, completed, starts) for r in grid), key=lambda r: r["trial"])
    summary = write_report(spec, sweep_dir, rows, not_started=num_trials(spec) - len(rows), address=address)
    try:
        trackers.SweepRuns.finish(spec.base_config(), sweep_dir, summary["best"],
                                  [sweep_dir / name for name in REPORT_FILES])
    except Exception as e:   # the tracker's copy of the report; the report itself is written
        log.warning(f"telemetry.mlflow: cannot finish the sweep's parent run ({type(e).__name__}: {str(e)[:300]})")
    for name in REPORT_FILES if mirror else ():
        sweep_mirror.push_file(sweep_dir / name, mirror)
    summary["fit_s"] = time.time() - t0
    return summary


def trial_row(spec: SweepSpec, sweep_dir: Path, result, completed: set[str],
              starts: list[dict[str, Any]]) -> dict[str, Any]:
    trial_id = Path(result.path).name
    params = {k: result.config[k] for k in spec.space}
    cfg = trial_config(spec, params)
    metrics = result.metrics or {}
    if metrics.get("final"):
        status, reason = "ok", ""
    elif result.error is not None:
        status, reason = "infeasible", report.failure_reason(result.error)
    elif trial_id in completed:
        status, reason = "stopped", "stopped early by ASHA"
    else:
        status, reason = "unfinished", "sweep interrupted; continue with --resume"
    attempts = attempts_of(sweep_dir / TRIALS_DIR / trial_id)
    attempt_records = [report.read_records(a) for a in attempts]
    cost = report.trial_cost(attempt_records,
                             metrics.get("eval_loss") if metrics.get("final") else None,
                             target=spec.target_loss, metric=spec.target_metric)
    return {"trial": trial_id, "params": params, "batch": cfg.train.global_batch_size,
            "precision": cfg.train.precision, "lr": cfg.train.lr, "status": status, "reason": reason,
            **{k: metrics.get(k) for k in ("samples", "samples_per_s", "peak_memory_mb", "eval_loss",
                                           "eval_accuracy", "time_to_target_s", "train_s")}, **cost,
            "steps": metrics.get("step"), "run_dir": str(attempts[-1]) if attempts else None,
            "attempts": len(attempts),
            **report.start_times(starts, trial_id, attempt_records[-1] if attempt_records else [])}


def write_report(spec: SweepSpec, sweep_dir: Path, rows: list[dict[str, Any]], *, not_started: int = 0,
                 address: str | None = None) -> dict[str, Any]:
    """`address`: the cluster the sweep ran on, which its resume command names."""
    key, mode = spec.metric
    best = report.best_row(rows, key, mode)
    extra = [k for k in spec.space if k not in ("train.global_batch_size", "train.precision")]
    table = report.format_table(rows, extra, best)
    report.write_csv(rows, sweep_dir / "results.csv", extra)
    summary = {"sweep_dir": str(sweep_dir), "objective": spec.objective, "metric": key, "mode": mode,
               "target_loss": spec.target_loss, "best": best["trial"] if best else None,
               "not_started": not_started, **report.median_start(rows), "trials": rows}
    (sweep_dir / "results.json").write_text(json.dumps(report.json_safe(summary), indent=1))
    curves = {r["trial"]: trial_history(sweep_dir / TRIALS_DIR / r["trial"]) for r in rows}
    report.plot(rows, curves, sweep_dir / "results.png", target=spec.target_loss)
    if best:
        config = trial_config(spec, best["params"]).to_dict()
        report.write_best(best, config, sweep_dir / "best.yaml", objective=f"{spec.objective} ({key} {mode})",
                          sweep_dir=sweep_dir)
    print(table, flush=True)     # the command's result: stdout
    if not_started or any(r["status"] == "unfinished" for r in rows):
        log.warning(f"sweep interrupted ({not_started} trials not started yet); continue it with: "
                    f"{commands.resume_sweep(sweep_dir, address)}")
    log.info(f"best ({spec.objective}): {best['trial'] if best else 'none (no trial finished with a value)'}; "
             f"results in {sweep_dir}; the report: {commands.report(sweep_dir)}")
    summary["table"] = table
    return summary


__all__ = ["run_sweep", "resume_sweep", "run_trial", "max_concurrent", "write_report", "SWEEP_FILE"]
