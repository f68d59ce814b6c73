"""Which path a run takes when one of its workers dies: pure, from the config (and whether torchft is installed).

  survivors     data-parallel layouts (pp = 1, every worker holds the whole model): the other workers keep
                training in memory, at the smaller size until Ray's replacement joins and copies a live peer
                (raydl.train.survivors), which waits for a node when the dead worker's node is gone (elastic
                runs too: raydl.driver.scaling_policy). At most the step in flight is redone.
  full restart  pipelines and FSDP/replicate (a worker holds what no other has), a single worker,
                scaling.survivors=off, or torchft missing: Ray restarts the whole group, which resumes from the
                last checkpoint and redoes the steps since.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from raydl.config import JobConfig
from raydl.errors import ConfigError, LayoutError
from raydl.parallel.batching import batch_split


@dataclass(frozen=True)
class RecoveryPath:
    survivors: bool
    why: str          # for a person: what decided it

    def describe(self) -> str:
        """The layout line's last part."""
        if self.survivors:
            return "a worker that dies: the others go on, its replacement copies a live peer (torchft)"
        return f"a worker that dies: the whole group restarts from the last checkpoint ({self.why})"


def torchft_installed() -> bool:
    return importlib.util.find_spec("torchft") is not None


def choose(cfg: JobConfig, *, torchft: bool) -> RecoveryPath:
    """The path, and why. scaling.survivors=on with a layout or install that cannot take it: ConfigError."""
    wanted = cfg.scaling.survivors
    blocked = _blocker(cfg, torchft=torchft) if wanted != "off" else "scaling.survivors=off"
    if blocked is None:
        return RecoveryPath(True, "data-parallel replicas")
    if wanted == "on":
        raise ConfigError("scaling.survivors", f"is on, but {blocked}",
                          "set scaling.survivors=auto (full restarts where survivors cannot go on) or change the "
                          "layout as said")
    return RecoveryPath(False, blocked)


def _blocker(cfg: JobConfig, *, torchft: bool) -> str | None:
    p, s, t = cfg.parallel, cfg.scaling, cfg.train
    if p.pp_degree != 1:
        return f"pipelines restart whole (parallel.pp_degree={p.pp_degree})"
    if p.dp_wrapper in ("fsdp", "replicate"):
        return f"parallel.dp_wrapper={p.dp_wrapper} shards state over the group; set ddp or auto"
    if t.optimizer_in_backward:
        return "train.optimizer_in_backward steps inside fully_shard's backward, before any peer could be missed"
    if s.max_workers < 2:
        return "a single worker has no survivors"
    if s.max_failures == 0:
        return "scaling.max_failures=0 ends the run at the first failure"
    if cfg.telemetry.profile_steps:
        return ("telemetry.profile_steps gathers every rank's profile over the group's process group, which the "
                "survivors' workers (a replica group each) do not share")
    for live in range(1, s.max_workers + 1):   # the survivors keep the global batch at every size they may reach
        try:
            batch_split(global_batch=t.global_batch_size, micro_batch=t.micro_batch_size, dp=live, strict=True)
        except LayoutError:
            return (f"train.global_batch_size={t.global_batch_size} does not split over {live} worker(s); "
                    f"make it a multiple of every size from 1 to scaling.max_workers")
    if not torchft:
        return "torchft is not installed (pip install torchft==0.2.0, a dependency of raydl)"
    return None
