"""One run preparation for both launchers (Ray Train on the driver, torchrun on every rank).

Everything that can be checked before any worker starts is checked here (config, dataset,
resume path, checkpoint/model match, layouts at every allowed world size), so bad input
fails in a second with exit code 2 and nothing written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raydl.config import JobConfig, default_run_dir
from raydl.data.dataset import check_task, open_dataset, resolve_path
from raydl.errors import ConfigError
from raydl.models.blocks import num_params
from raydl.models.registry import get_spec
from raydl.overrides import dump_yaml
from raydl.parallel.mesh import Layout
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
    if Layout.needs_profile(cfg):
        return   # planned on the workers, from a profile measured on their devices
    for world_size in sorted({cfg.scaling.min_workers, cfg.scaling.max_workers}):
        Layout.from_config(cfg, world_size, num_blocks=num_blocks)
