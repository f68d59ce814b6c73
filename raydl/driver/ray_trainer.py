"""Driver side of `raydl train`: prepared run -> Ray Train `TorchTrainer` -> summary.

`raydl.driver.prepare` checks everything it can before Ray starts; then the per-worker loop
(`raydl.train.loop.train_worker`) runs on every worker.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from raydl import commands
from raydl import log as raydl_log
from raydl import storage
from raydl.config import JobConfig
from raydl.driver.cluster_watch import ClusterWatch, cluster_lost_message
from raydl.driver.ray_output import RAY_LOG, route_to
from raydl.driver.prepare import PreparedRun, prepare_run, remove_if_never_started
from raydl.driver.run_location import checkpoint_storage, checkpoints_location
from raydl.driver.shared_storage import check_shared_checkpoints, check_shared_dataset
from raydl.signals import SignalStop
from raydl.errors import ClusterLost, ConfigError, RunFailed, one_line, raydl_error_in
from raydl.models.spec import ModelSpec
from raydl.parallel import float8
from raydl.telemetry import startup

log = logging.getLogger(__name__)


def ray_env(cfg: JobConfig) -> dict[str, str]:
    """Env for the Train controller and workers. Ray reads its timing knobs from env vars."""
    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, int(cfg.scaling.cpus_per_worker)))),
        # The controller drains reports once per poll (train/v2/_internal/execution/controller): a shorter poll keeps reporting cheap.
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"),
        # After a node loss Ray first retries the stale, larger size until this times out (measured: raydl bench recovery).
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(cfg.scaling.worker_start_timeout_s),
        **raydl_log.worker_env(),
        # The bucket's endpoint and region, as the driver sees them (local Ray workers inherit the rest).
        **{k: os.environ[k] for k in storage.FORWARDED_ENV if k in os.environ},
    }
    # torchft's Rust Lighthouse and Manager (the survivors path) log every step's quorum at INFO.
    env["RUST_LOG"] = os.environ.get("RUST_LOG", "warn")
    # Train patches print() on workers to tee into its logger too: every raydl line would show twice.
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    if "ONEDNN_MAX_CPU_ISA" in os.environ:   # only when the user capped it: raydl never caps it by itself
        env["ONEDNN_MAX_CPU_ISA"] = os.environ["ONEDNN_MAX_CPU_ISA"]
    return env


# Set in every process of a Ray that raydl started privately for this process (no --address).
PRIVATE_RAY_ENV = "RAYDL_PRIVATE_RAY"


def cluster_address(address: str | None) -> str | None:
    """The cluster a run joins: `address` (--address), else RAY_ADDRESS as ray.init reads it (`ray job submit` sets
    it to "auto" for its entrypoint), else None: a private local Ray. An http(s):// RAY_ADDRESS names a job server
    (`raydl submit`, `ray job`), not a cluster a driver joins: it is left to those."""
    if address:
        return address
    from_env = os.environ.get("RAY_ADDRESS", "").strip()
    return from_env if from_env and not from_env.startswith(("http://", "https://")) else None


def connect(address: str | None, env: dict[str, str]) -> bool:
    """Join the cluster at `address`, or start a private local Ray; True if this call started the connection
    (False: the caller had called ray.init)."""
    import ray

    os.environ.update(env)   # Train V2 hands these from the driver to the controller and workers
    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": env}
    if address:
        try:
            # Ray's INFO lines ("Connecting to existing Ray cluster at address ...") only with -v.
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True,
                     logging_level=raydl_log.ray_log_level())
        except (ConnectionError, RuntimeError) as e:
            raise ConfigError("--address", f"{address} names no Ray cluster this process can join ({one_line(e)})",
                              "check that the cluster is up (`ray status` on its head), the host and GCS port "
                              "(6379 by default), and its auth token (RAY_AUTH_TOKEN, ~/.ray/auth_token); or drop "
                              "--address to train on a private local Ray") from None
    else:
        # address="local": a private Ray of this process; plain ray.init() would join any cluster that
        # `ray start` left on this machine. No dashboard. Ray 2.60 cannot bind to loopback: it maps a
        # 127.0.0.1 node address to the machine's own, and its GCS and raylet listen on all interfaces
        # (hard-coded), protected by Ray's token authentication, which is on by default.
        # Nothing preempts a private local Ray, and Train's PreemptionWatcher actor only logs an error there.
        os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
        env = {**env, PRIVATE_RAY_ENV: "1"}   # every process of this cluster (sweep trials too) can tell
        runtime_env = {"env_vars": env}
        os.environ[PRIVATE_RAY_ENV] = "1"
        # Ray warns on every start of a local cluster that token auth is on, its default (RAY_AUTH_MODE unset):
        # nothing a user of this private cluster acts on (shown with --verbose).
        if raydl_log.ray_log_level() > logging.INFO:
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        ray.init(address="local", runtime_env=runtime_env, include_dashboard=False,
                 logging_level=raydl_log.ray_log_level())
    return True


def workers_that_fit(per_worker: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many workers of `per_worker` resources the nodes can place (a worker lives on one node)."""
    return sum(int(min(node.get(k, 0.0) / v for k, v in per_worker.items() if v > 0)) for node in nodes)


def check_cluster_fits(cfg: JobConfig, per_worker: dict[str, float], *, can_grow: bool) -> None:
    """Fail in seconds, with the numbers, when the cluster can never place scaling.min_workers workers
    (Ray would retry forever). A cluster that may autoscale gets scaling.fit_timeout_s to grow first."""
    import ray

    deadline = time.monotonic() + (cfg.scaling.fit_timeout_s if can_grow else 0.0)
    while True:
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        fit = workers_that_fit(per_worker, nodes)
        if fit >= cfg.scaling.min_workers:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)   # polling the cluster's node list, bounded by the deadline above
    asked = ", ".join(f"{v:g} {k}" for k, v in per_worker.items())
    have = ", ".join(f"{k} {sum(n.get(k, 0.0) for n in nodes):g}" for k in per_worker)
    waited = f" after waiting {cfg.scaling.fit_timeout_s:g} s for the cluster to grow" if can_grow else ""
    raise ConfigError("scaling.min_workers", f"asks for {cfg.scaling.min_workers} workers of {asked} each, but the "
                      f"cluster ({len(nodes)} node(s); {have}) can place only {fit}{waited}",
                      "lower scaling.min_workers, scaling.cpus_per_worker or scaling.gpus_per_worker, or add nodes "
                      "(an autoscaling cluster: raise scaling.fit_timeout_s)")


def warn_if_reads_cannot_run(cfg: JobConfig) -> None:
    """data.backend=ray needs CPUs beside the workers' for its read tasks, or the workers wait forever.
    A warning, not an error: an autoscaling cluster may add the CPUs once the run asks for them."""
    import ray

    if cfg.data.backend != "ray":
        return
    cpus = ray.cluster_resources().get("CPU", 0)
    workers = cfg.scaling.max_workers * cfg.scaling.cpus_per_worker
    if cpus - workers < cfg.data.read_cpus:
        log.warning(f"data.backend=ray: the cluster has {cpus:g} CPUs and {cfg.scaling.max_workers} "
                    f"workers take {workers:g}, which leaves less than data.read_cpus={cfg.data.read_cpus:g} for Ray "
                    f"Data's read tasks; training waits until a CPU frees up. Fix: lower scaling.cpus_per_worker or "
                    f"scaling.max_workers, lower data.read_cpus, add CPUs, or use data.backend=arrow.")


def use_gpu(cfg: JobConfig) -> bool:
    import ray

    if cfg.scaling.use_gpu == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return cfg.scaling.use_gpu == "true"


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    """raydl.train.loop.train_worker, imported on the worker only: its imports (torch.distributed.checkpoint,
    torch._dynamo) took the driver a second or more before `fit`, for a function only the workers run."""
    from raydl.train.loop import train_worker

    return train_worker(job)


def build_trainer(run: PreparedRun, *, callbacks=()):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig

    from raydl.driver.callbacks import FailureCauseCallback
    from raydl.driver.failure_policy import RaydlTrainer
    from raydl.metrics import run_mirror
    from raydl.metrics.sink import start_sink
    from raydl.metrics import trackers
    from raydl.metrics.tensorboard import events_dir

    s, cfg = run.cfg.scaling, run.cfg
    run.job["metrics_sink"] = f"raydl-metrics-{run.job['run_id']}"
    storage_path, name = checkpoint_storage(cfg, run.run_dir, run.job["run_id"])
    sink = start_sink(run.job["metrics_sink"], str(run.run_dir), cfg.telemetry.progress, events_dir(cfg, run.job),
                      trackers.settings_for(cfg, run.job), run_mirror.location(storage.join(storage_path, name)))
    holder = start_state_holder(run)   # before the trainer: it names the holder in run.job
    resources = worker_resources(cfg)
    elastic = s.min_workers < s.max_workers
    gpu = "GPU" in resources
    members = survivors_callbacks(run)
    trainer = RaydlTrainer(
        run_worker,
        train_loop_config=run.job,
        torch_config=survivors_backend(cfg) if run.job.get("recovery", {}).get("survivors") else None,
        scaling_config=ScalingConfig(num_workers=(s.min_workers, s.max_workers) if elastic else s.max_workers,
                                     use_gpu=gpu, resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=s.resize_check_s),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=s.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            # Also when connecting to a Ray that was started with another runtime env.
            worker_runtime_env={"env_vars": ray_env(cfg)},
            callbacks=[FailureCauseCallback(run.job["metrics_sink"], deaths_said_elsewhere=bool(members)), *members,
                       *callbacks],
            # Ray logs every report's full metrics at INFO; raydl logs its own progress line.
            logging_config=LoggingConfig(log_level=logging.getLevelName(raydl_log.ray_log_level())),
        ),
    )
    trainer.private_ray = os.environ.get(PRIVATE_RAY_ENV) == "1"
    trainer.metrics_sink = sink   # the actor lives as long as a handle to it does
    trainer.run_dir = run.run_dir
    trainer.state_holder = holder
    return trainer


def start_state_holder(run: PreparedRun):
    """The run's state holder (restart from memory, docs/restart-from-memory.md) on this node, which outlives any
    worker; none when it is off, when no failure is retried (a sweep trial: max_failures=0), or on the survivors
    path (a dead worker's replacement copies a live peer: docs/recovery.md)."""
    from raydl.node_actor import start_on_this_node
    from raydl.train.state_holder import StateHolder

    if not run.cfg.checkpoint.memory_every_steps or run.cfg.scaling.max_failures == 0 or \
            run.job.get("recovery", {}).get("survivors"):
        return None
    run.job["state_holder"] = f"raydl-state-{run.job['run_id']}"
    return start_on_this_node(StateHolder, run.job["state_holder"])


def survivors_backend(cfg: JobConfig):
    """Ray Train's torchft backend (raydl.driver.survivors_backend): one replica group per worker, so that Ray
    replaces a dead worker alone while the others go on (raydl.train.survivors). The Lighthouse forms a
    quorum once every member of the last one asked for it (raydl.train.survivors: after a failure, or when a
    replica asks for one). A dead worker is noticed by its heartbeats
    stopping: after scaling.survivor_timeout_s (each worker's torchft Manager sends one every tenth of it, from a
    thread of its own, so a busy machine would have to hold ten back), the survivors go on without it. A live
    worker that is late (a busy machine, the leader writing a checkpoint alone) is waited for as long as the
    others' quorum request waits (raydl.train.survivors.TIMEOUT: join_timeout_ms; with 2 workers the Lighthouse
    never forms a quorum of one while the other still sends heartbeats). min_replicas=1: the survivors go on at
    any size."""
    from raydl.driver.survivors_backend import RaydlTorchftConfig
    from raydl.train.survivors import TIMEOUT

    return RaydlTorchftConfig(lighthouse_kwargs={
        "min_replicas": 1, "heartbeat_timeout_ms": int(cfg.scaling.survivor_timeout_s * 1000),
        "join_timeout_ms": int(TIMEOUT.total_seconds() * 1000)})


def survivors_callbacks(run: PreparedRun) -> list:
    """On the survivors path: the controller's view of each worker lost and replaced, to the console and the run's
    record (raydl.driver.member_watch)."""
    from raydl.driver.member_watch import MemberWatch

    return [MemberWatch(run.job["metrics_sink"])] if run.job.get("recovery", {}).get("survivors") else []


def run_training(cfg: JobConfig, *, address: str | None = None, resume: str | None = None,
                 model: ModelSpec | None = None) -> dict[str, Any]:
    """`model`: a spec object that replaces the one model.name names (raydl.train(model=...))."""
    t0 = time.time()
    marks = startup.Marks(command_start=min(startup.command_start(), t0))
    raydl_log.ensure_configured()
    float8.check_before_start(cfg.train.precision, workers_on_gpu=False if cfg.scaling.use_gpu == "false" else None,
                              local=address is None)
    run = prepare_run(cfg, resume=resume, model=model, cluster=address is not None)
    marks.mark("prepared")
    log.info(f"run directory: {run.run_dir}")
    try:
        result = fit(run, address, marks)
    except BaseException:
        if remove_if_never_started(run.run_dir):
            log.info(f"removed {run.run_dir}: the run failed before its first step")
        raise
    summary_path = run.run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    checkpoint = storage.uri(result.checkpoint.filesystem, result.checkpoint.path) if result.checkpoint else None
    summary.update(wall_s=time.time() - t0, checkpoint=checkpoint, run_dir=str(run.run_dir),
                   resumed_from=run.job["resume_from"], **startup_section(run, marks))
    summary_path.write_text(json.dumps(summary, indent=1))
    if summary.get("stopped_by_signal"):
        log.warning(f"stopped at step {summary['steps']} with checkpoint {summary['checkpoint']}; resume with: "
                    f"{commands.resume_run(run.run_dir, address)}")
    else:
        log.info(f"finished at step {summary.get('steps')}; the run's report: {commands.report(run.run_dir)}")
    return summary


def worker_resources(cfg: JobConfig) -> dict[str, float]:
    s = cfg.scaling
    return {"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if use_gpu(cfg) else {})}


def startup_section(run: PreparedRun, marks: startup.Marks) -> dict[str, Any]:
    """summary.json's `startup`: the driver's marks and the first worker group's (from its first step record)."""
    metrics, group_marks = run.run_dir / "metrics.jsonl", {}
    if metrics.exists():
        with metrics.open() as lines:
            group_marks = json.loads(lines.readline() or "{}").get("startup", {})
    return {"startup": startup.breakdown({**marks, **group_marks})}


def fit(run: PreparedRun, address: str | None, marks: startup.Marks):
    """Ray's own console lines go to the run's ray.log meanwhile (raydl.driver.ray_output)."""
    with route_to(run.run_dir / RAY_LOG, keep_after=connect(address, ray_env(run.cfg))):
        return fit_connected(run, address, marks)


def fit_connected(run: PreparedRun, address: str | None, marks: startup.Marks):
    from ray.exceptions import RayActorError, RaySystemError

    from raydl.metrics.sink import WORKERS_LOG

    marks.mark("ray_connected")
    check_cluster_fits(run.cfg, worker_resources(run.cfg), can_grow=address is not None)
    float8.check_before_start(run.cfg.train.precision, workers_on_gpu=use_gpu(run.cfg), local=False)
    check_shared_checkpoints(run.cfg)
    check_shared_dataset(run.cfg, run.job["data_path"])
    warn_if_reads_cannot_run(run.cfg)
    watch = ClusterWatch(str(run.run_dir), address, ClusterLost.exit_code)
    try:
        trainer = build_trainer(run)
        run.job["stop_actor"] = run.job["metrics_sink"]   # raydl.metrics.sink.MetricsSink.request_stop
        # A signal before this point stops at once: nothing has trained yet.
        with SignalStop(on_first=lambda signum: trainer.metrics_sink.request_stop.remote(signum)), watch:
            marks.mark("fit_called")
            return trainer.fit()
    except (RayActorError, RaySystemError) as e:   # the Train controller itself is gone: its cluster went away
        raise ClusterLost(cluster_lost_message(str(run.run_dir), address,
                                               f"Ray Train's controller died ({one_line(e)[:300]})")) from None
    except Exception as e:
        user_error = raydl_error_in(e) or run_failed(run, e, address)
        if user_error is None:
            raise
        workers_log = run.run_dir / WORKERS_LOG
        user_error.log_file = str(workers_log) if workers_log.exists() else None
        raise user_error from None   # bad data or checkpoint found by a worker: exit 2, not a traceback


def run_failed(run: PreparedRun, error: Exception, address: str | None) -> RunFailed | None:
    """Ray Train's failure after its retries as one paragraph: the cause, the newest checkpoint and the command that
    resumes from it (the tracebacks are in workers.log)."""
    from ray.train import TrainingFailedError

    from raydl.train import checkpoint as ckpt
    from raydl.tune.report import failure_reason

    if not isinstance(error, TrainingFailedError):
        return None
    failures = sorted(getattr(error, "worker_failures", {}).items())
    where, cause = (f"worker {failures[0][0]}", failures[0][1]) if failures else ("Ray Train's controller", error)
    latest = ckpt.find_latest(checkpoints_location(str(run.run_dir)))
    then = (f"resume from its newest checkpoint, {latest}, with `{commands.resume_run(run.run_dir, address)}`" if latest
            else "start it again (it saved no checkpoint)")
    return RunFailed(f"the run failed after {run.cfg.scaling.max_failures} restart(s) of its worker group: {where} "
                     f"raised {failure_reason(cause)}. Fix: remove the cause, then {then}.")

