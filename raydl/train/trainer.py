"""Driver side of `raydl train`: JobConfig -> run directory -> Ray Train `TorchTrainer` -> summary.

Everything that can be checked before Ray starts is checked here (config, dataset, resume
path, checkpoint/model match), so bad input fails in a second with exit code 2 and nothing
written. Then the per-worker loop (`raydl.train.loop.train_worker`) runs on every worker.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raydl.config import JobConfig, default_run_dir
from raydl.data.dataset import check_task, open_dataset, resolve_path
from raydl.errors import ConfigError, RaydlError
from raydl.models.blocks import num_params
from raydl.models.registry import get_spec
from raydl.overrides import dump_yaml
from raydl.parallel.mesh import resolve_layout
from raydl.train import checkpoint as ckpt


@dataclass
class PreparedRun:
    cfg: JobConfig
    run_dir: Path
    job: dict[str, Any]      # what every worker receives: plain JSON data


def prepare_run(cfg: JobConfig, *, resume: str | None = None) -> PreparedRun:
    """Validate everything checkable on the driver, then create the run directory."""
    spec = get_spec(cfg.model)
    data_path = resolve_path(cfg, spec.task)
    info = open_dataset(data_path)
    check_task(info, spec.task, spec.name)
    model = spec.build(cfg.model, info.meta)
    check_layout(cfg, num_blocks=len(model.blocks))
    resume_from = None
    if resume:
        resume_from = ckpt.resolve_resume(resume)
        ckpt.check_compatible(ckpt.read_state(resume_from),
                              {"name": cfg.model.name, "size": cfg.model.size, "params": num_params(model),
                               "blocks": len(model.blocks)}, resume_from)
    run_dir = default_run_dir(cfg, time.strftime("%Y%m%d-%H%M%S")).resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError("run.dir", f"'{run_dir}' already holds a run", "choose a new run.dir (raydl never writes "
                          "over a run), or pass --resume with it to continue from its checkpoint")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    job = {"config": cfg.to_dict(), "data_path": str(Path(data_path).resolve()) if "://" not in data_path else data_path,
           "run_dir": str(run_dir), "resume_from": str(resume_from) if resume_from else None}
    return PreparedRun(cfg, run_dir, job)


def check_layout(cfg: JobConfig, *, num_blocks: int) -> None:
    """Fail on the driver (exit 2) for a layout no worker group could run, at every allowed size."""
    if cfg.parallel.pp_degree == "auto":
        return
    from raydl.parallel.pipeline import validate

    for world_size in sorted({cfg.scaling.min_workers, cfg.scaling.max_workers}):
        layout = resolve_layout(cfg, world_size=world_size, num_blocks=num_blocks)
        if layout.pp > 1:
            validate(layout, num_blocks=num_blocks, precision=cfg.train.precision, dp_wrapper=cfg.parallel.dp_wrapper)


def ray_env(cfg: JobConfig) -> dict[str, str]:
    """Env for the Train controller and workers. Ray reads its timing knobs from env vars."""
    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, int(cfg.scaling.cpus_per_worker)))),
        # Reports are drained once per poll (RAY_NOTES P1): a shorter poll keeps reporting cheap.
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"),
        # After a node loss Ray first retries the stale, larger size until this times out (RAY_NOTES P4).
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(cfg.scaling.worker_start_timeout_s),
    }
    if "ONEDNN_MAX_CPU_ISA" in os.environ:   # only when the user capped it: raydl never caps it by itself
        env["ONEDNN_MAX_CPU_ISA"] = os.environ["ONEDNN_MAX_CPU_ISA"]
    env.update({k: v for k, v in os.environ.items() if k.startswith("RAYDL_")})   # raydl's own hooks
    return env


def user_error_from(error: BaseException) -> RaydlError | None:
    """The RaydlError a worker raised, out of Ray's wrappers (WorkerGroupError, RayTaskError, causes)."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RaydlError):
            return e
        todo.extend([e.__cause__, e.__context__, *getattr(e, "worker_failures", {}).values()])
        if hasattr(e, "as_instanceof_cause"):
            todo.append(getattr(e, "cause", None))
    return None


def connect(address: str | None, env: dict[str, str]) -> None:
    import ray

    os.environ.update(env)   # Train V2 hands these from the driver to the controller and workers
    if ray.is_initialized():
        return
    runtime_env = {"env_vars": env}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(runtime_env=runtime_env, include_dashboard=False)


def warn_if_reads_cannot_run(cfg: JobConfig) -> None:
    """data.backend=ray needs CPUs beside the workers' for its read tasks, or the workers wait forever.
    A warning, not an error: an autoscaling cluster may add the CPUs once the run asks for them."""
    import ray

    if cfg.data.backend != "ray":
        return
    cpus = ray.cluster_resources().get("CPU", 0)
    workers = cfg.scaling.max_workers * cfg.scaling.cpus_per_worker
    if cpus - workers < cfg.data.read_cpus:
        print(f"[raydl] warning: data.backend=ray: the cluster has {cpus:g} CPUs and {cfg.scaling.max_workers} "
              f"workers take {workers:g}, which leaves less than data.read_cpus={cfg.data.read_cpus:g} for Ray Data's "
              f"read tasks; training waits until a CPU frees up. Fix: lower scaling.cpus_per_worker or "
              f"scaling.max_workers, lower data.read_cpus, add CPUs, or use data.backend=arrow.", flush=True)


def use_gpu(cfg: JobConfig) -> bool:
    import ray

    if cfg.scaling.use_gpu == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return cfg.scaling.use_gpu == "true"


def build_trainer(run: PreparedRun, *, callbacks=()):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raydl.telemetry.callbacks import MetricsCallback
    from raydl.train.loop import train_worker

    s, cfg = run.cfg.scaling, run.cfg
    gpu = use_gpu(cfg)
    resources = {"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if gpu else {})}
    elastic = s.min_workers < s.max_workers
    storage = cfg.checkpoint.storage_path or str(run.run_dir)
    return TorchTrainer(
        train_worker,
        train_loop_config=run.job,
        scaling_config=ScalingConfig(num_workers=(s.min_workers, s.max_workers) if elastic else s.max_workers,
                                     use_gpu=gpu, resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=s.resize_check_s),
        run_config=RunConfig(
            name="train" if not cfg.checkpoint.storage_path else run.run_dir.name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=s.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            # Also when connecting to a Ray that was started with another runtime env.
            worker_runtime_env={"env_vars": ray_env(cfg)},
            callbacks=[MetricsCallback(str(run.run_dir), cfg.telemetry.progress), *callbacks],
            # Ray logs every report's full metrics at INFO; raydl prints its own progress line.
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )


def run_training(cfg: JobConfig, *, address: str | None = None, resume: str | None = None) -> dict[str, Any]:
    t0 = time.time()
    run = prepare_run(cfg, resume=resume)
    print(f"[raydl] run directory: {run.run_dir}", flush=True)
    connect(address, ray_env(cfg))
    warn_if_reads_cannot_run(cfg)
    try:
        result = build_trainer(run).fit()
    except Exception as e:
        user_error = user_error_from(e)
        if user_error is None:
            raise
        raise user_error from None   # bad data or checkpoint found by a worker: exit 2, not a traceback
    summary_path = run.run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.update(wall_s=time.time() - t0, checkpoint=result.checkpoint.path if result.checkpoint else None,
                   run_dir=str(run.run_dir))
    summary_path.write_text(json.dumps(summary, indent=1))
    return summary
