"""One run preparation for both launchers (Ray Train on the driver, torchrun on every rank).

Everything that can be checked before any worker starts is checked here (config, dataset,
resume path, checkpoint/model match, layouts at every allowed world size), so bad input
fails in a second with exit code 2 and nothing written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raydl import storage
from raydl.config import JobConfig, default_run_dir
from raydl.driver import init_from, lora_base
from raydl.driver import resume as resume_record
from raydl.driver.run_location import RUN_ID_FILE, checkpoints_location, read_run_id
from raydl.metrics import tensorboard, trackers
from raydl.errors import ConfigError
from raydl.models.build import SkipWeightInit
from raydl.models.choice import choose_model
from raydl.models.spec import ModelSpec
from raydl.overrides import dump_yaml
from raydl.parallel import recovery
from raydl.parallel.memory import ModelMemory
from raydl.parallel.memory_probe import model_memory
from raydl.parallel.mesh import layout_for, needs_profile
from raydl.parallel.profile import memory_budget
from raydl.telemetry.cost import Pricing



log = logging.getLogger(__name__)


@dataclass
class PreparedRun:
    cfg: JobConfig
    run_dir: Path
    job: dict[str, Any]      # what every worker receives: plain JSON data, and the spec object of `model`


def prepare_run(cfg: JobConfig, *, resume: str | None = None, run_dir: str | Path | None = None,
                launcher: str = "ray", write: bool = True, model: ModelSpec | None = None,
                cluster: bool = False) -> PreparedRun:
    """Validate everything checkable before any worker starts, then claim the run directory.

    `launcher="ray"`: a new run directory, always (raydl never writes over a run). `"torchrun"`:
    every rank calls this and only rank 0 writes (`write`); a directory that holds the same
    config is the same run restarting (torchrun --max-restarts) and is reused as it is.
    `model`: a spec object (raydl.train(model=...)) that replaces model.name; it travels in the
    job, pickled by Ray."""
    tensorboard.require_installed(cfg)
    trackers.require_installed(cfg)
    if cfg.checkpoint.storage_path:   # a bucket that is missing or refuses us fails here, not at the first upload
        storage.check(cfg.checkpoint.storage_path, "checkpoint.storage_path")
    Pricing.for_config(cfg)     # a cost.instance_type missing from the price table fails here, not mid-run
    cfg = init_from.as_hf_weights(cfg, model.name if model else cfg.model.name)
    chosen = choose_model(cfg.model, model)
    info = chosen.open_dataset(cfg)
    data_path = info.root
    with torch.device("meta"), SkipWeightInit():   # shapes only: counting blocks and parameters allocates no weights
        built = chosen.build(info.meta, pp_degree=cfg.parallel.pp_degree)
    if write and chosen.spec.blocks:
        chosen.check_blocks(info.meta)
    trained = lora_base.adapted(chosen, info.meta, cfg, built)
    memory = model_memory(trained, chosen.spec, info.meta, activations=checks_memory(cfg, local=not cluster))
    check_layout(cfg, num_blocks=len(built.blocks), model_memory=memory, local=not cluster, launcher=launcher)
    # torchrun restarts its whole group itself; under Ray a data-parallel layout may keep its survivors going.
    path = recovery.choose(cfg, torchft=recovery.torchft_installed()) if launcher == "ray" else None
    init_checkpoint = init_from.resolve(cfg, built, info.meta)
    adapters = lora_base.lora_fingerprint(cfg, init_checkpoint)
    dataset = resume_record.dataset_record(data_path, info.digest, info.meta)
    fingerprint = {**chosen.fingerprint(built), **adapters}
    resume_from = check_resume(resume, cfg, fingerprint, dataset, announce=write) if resume else None
    run_dir = Path(run_dir or default_run_dir(cfg, time.strftime("%Y%m%d-%H%M%S"))).resolve()
    run_id = claim_run_dir(run_dir, cfg, reuse_same_config=launcher == "torchrun", write=write)
    if write and not (run_dir / resume_record.DATASET_FILE).exists():
        (run_dir / resume_record.DATASET_FILE).write_text(json.dumps(dataset))
    local_data = not storage.is_uri(data_path)
    job = {"config": cfg.to_dict(), "data_path": str(Path(data_path).resolve()) if local_data else data_path,
           "run_dir": str(run_dir), "run_id": run_id, "resume_from": str(resume_from) if resume_from else None,
           "init_from": init_checkpoint, "model": model, "import_dir": chosen.import_dir, "lora_fingerprint": adapters}
    if path:
        job["recovery"] = dataclasses.asdict(path)
    return PreparedRun(cfg, run_dir, job)


def check_resume(resume: str, cfg: JobConfig, fingerprint: dict[str, Any], dataset: dict[str, Any], *,
                 announce: bool) -> Path | str:
    """The checkpoint to continue from, once this run's model and dataset are known to match it (else the error
    naming the field that changed); `announce`: log the fields that differ from the run's (one line)."""
    from raydl.train import checkpoint as ckpt   # only here: it imports torch.distributed.checkpoint (~1 s)

    resume_from = ckpt.resolve_resume(checkpoints_location(resume))
    record = resume_record.find_run(resume)
    diff = resume_record.config_diff(record.tree, cfg.to_dict()) if record else []
    if announce:
        log.info(resume_record.diff_line(record, diff) if record else
                 f"--resume {resume}: no config.yaml of its run found, so the config is --config/--set over the defaults")
    saved_model = ckpt.read_state(resume_from).get("model", {})
    lora_base.check_same_base(saved_model, fingerprint, str(resume_from))
    problem = resume_record.refusal(record, diff, checkpoint=str(resume_from), dataset=dataset, built_model=fingerprint,
                                    saved_model=saved_model)
    if problem:
        raise problem
    return resume_from


def claim_run_dir(run_dir: Path, cfg: JobConfig, *, reuse_same_config: bool, write: bool) -> str | None:
    """Create the run directory with its config.yaml and run id (`write`), or reuse it when that is allowed.
    Returns the run id (None on the ranks that do not write a new one)."""
    config_text = dump_yaml(cfg)
    if run_dir.exists() and any(run_dir.iterdir()):
        same_run = (run_dir / "config.yaml").is_file() and (run_dir / "config.yaml").read_text() == config_text
        if not (reuse_same_config and same_run):
            raise ConfigError("run.dir", f"'{run_dir}' already holds a run{'' if same_run else ' with another config'}",
                              "choose a new run.dir or --run-dir (raydl never writes over a run), or pass --resume "
                              "with it to continue from its checkpoints in a new run directory")
        return read_run_id(run_dir)
    if not write:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_text)
    run_id = uuid.uuid4().hex[:12]
    (run_dir / RUN_ID_FILE).write_text(run_id)
    return run_id


def remove_if_never_started(run_dir: Path) -> bool:
    """Remove a run directory that a failed run left without a step, a checkpoint or the workers' tracebacks
    (which the error names); True if removed.

    Only the files raydl itself writes before the first step may be there, so nothing of anyone else's goes."""
    from raydl.metrics.sink import WORKERS_LOG
    from raydl.train import checkpoint as ckpt   # only on a failure: see prepare_run

    if (run_dir / "metrics.jsonl").exists() or (run_dir / WORKERS_LOG).exists() or ckpt.all_complete(run_dir):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def checks_memory(cfg: JobConfig, *, local: bool) -> bool:
    """Whether `check_layout` predicts the layout's peak memory: there is a budget to hold it to (this machine's
    for local workers, else scaling.memory_per_worker_gb) and the layout is not planned on the workers."""
    return not needs_profile(cfg) and (local or cfg.scaling.memory_per_worker_gb > 0)


def check_layout(cfg: JobConfig, *, num_blocks: int, model_memory: ModelMemory | None = None, local: bool = True,
                 launcher: str = "ray") -> None:
    """Fail on the driver (exit 2) for a layout no worker group could run, at every allowed size: torch would
    refuse it, or its predicted peak memory exceeds a worker's budget (scaling.memory_per_worker_gb, else, for
    workers on this machine, its GPU's memory or its RAM shared by the workers)."""
    if needs_profile(cfg):
        return   # planned on the workers, from a profile measured on their devices
    device = torch.device("cuda" if cfg.scaling.use_gpu != "false" and torch.cuda.is_available() else "cpu")
    known = model_memory is not None and checks_memory(cfg, local=local)
    for world_size in sorted({cfg.scaling.min_workers, cfg.scaling.max_workers}):
        on_host = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if launcher == "torchrun" else world_size
        budget = memory_budget(cfg, device, on_host) if known else 0
        layout_for(cfg, world_size, num_blocks=num_blocks, memory_bytes=budget,
                           param_bytes=model_memory.param_bytes if model_memory else 0,
                           model_memory=model_memory if known else None, device_type=device.type)
