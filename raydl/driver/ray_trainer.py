"""Driver side of `raydl train`: prepared run -> Ray Train `TorchTrainer` -> summary.

`raydl.driver.prepare` checks everything it can before Ray starts; then the per-worker loop
(`raydl.train.loop.train_worker`) runs on every worker.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from raydl.config import JobConfig
from raydl.driver.prepare import PreparedRun, prepare_run


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
    return env


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

    from raydl.driver.callbacks import MetricsCallback
    from raydl.driver.failure_policy import RaydlTrainer
    from raydl.train.loop import train_worker

    s, cfg = run.cfg.scaling, run.cfg
    gpu = use_gpu(cfg)
    resources = {"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if gpu else {})}
    elastic = s.min_workers < s.max_workers
    storage = cfg.checkpoint.storage_path or str(run.run_dir)
    return RaydlTrainer(
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
    from raydl.driver.failure_policy import raydl_error_in

    try:
        result = build_trainer(run).fit()
    except Exception as e:
        user_error = raydl_error_in(e)
        if user_error is None:
            raise
        raise user_error from None   # bad data or checkpoint found by a worker: exit 2, not a traceback
    summary_path = run.run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.update(wall_s=time.time() - t0, checkpoint=result.checkpoint.path if result.checkpoint else None,
                   run_dir=str(run.run_dir))
    summary_path.write_text(json.dumps(summary, indent=1))
    return summary
