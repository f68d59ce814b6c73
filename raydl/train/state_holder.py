"""The state holder: every rank's shard of the latest training state of one run, kept in RAM outside the workers.

A Ray actor on the driver's node (started by the driver, `raydl.driver.ray_trainer`), so it outlives any
worker and any worker node: after a worker dies and Ray restarts the whole group (pipelines, FSDP), the new
group reloads the step the old one finished last from here instead of the last storage checkpoint, and redoes
at most the step that was in flight. Storage checkpoints stay: they survive the driver and resize to any layout.

What it keeps: per (worker group, step), each sending rank's shard as `raydl.train.memory_state` took it (model
and optimizer tensors of the rank's part of the model, step, data position, scaler). Replicas send once: with
DDP or replicate only the ranks of data-parallel rank 0 send (one per pipeline stage) and the other replicas
reload their copy; with FSDP every rank holds a shard of its own and sends it (`senders`). A step counts once
every sender of its layout has handed its shard over ("complete"); the newest complete step is kept and
everything older is dropped, so the holder holds one copy of the whole state, plus, while the next step's
shards arrive, the shards received of it (at most two copies). A worker group that starts claims the holder (`begin_group`): from
then on shards of older groups (sent by a worker that died with its send in flight) are refused.

Plain Python, tested without Ray (tests/unit/test_state_holder.py); Ray runs it as an actor.
"""

from __future__ import annotations

from typing import Any

import torch

# Layout fields that decide which tensors a rank holds: a state is reloadable only into the same ones.
LAYOUT_KEYS = ("world_size", "dp", "pp", "num_microbatches", "micro_batch", "schedule", "stage_cuts", "dp_wrapper")


def layout_key(layout: dict[str, Any]) -> dict[str, Any]:
    return {k: layout.get(k) for k in LAYOUT_KEYS}


def sharded(layout: dict[str, Any]) -> bool:
    """Whether data-parallel ranks hold different tensors (FSDP) rather than replicas."""
    return layout["dp_wrapper"] == "fsdp" and layout["dp"] > 1


def senders(layout: dict[str, Any]) -> int:
    """How many ranks hand their shard over: ranks 0..n-1 (rank = dp_rank * pp + pp_rank, as in Layout.coords)."""
    return layout["world_size"] if sharded(layout) else layout["pp"]


def source_rank(layout: dict[str, Any], rank: int) -> int:
    """The rank whose held shard `rank` reloads: its own, or its stage's replica at data-parallel rank 0."""
    return rank if sharded(layout) else rank % layout["pp"]


def owned_copy(obj: Any) -> Any:
    """`obj` with every tensor copied into this process's own memory: what Ray hands an actor may be a view of
    a buffer that the sender owns and that is freed with it."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: owned_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(owned_copy(v) for v in obj)
    return obj


class StateHolder:
    def __init__(self):
        self.generation = 0
        # (generation, step) -> {"layout": layout_key, "ranks": {rank: shard}}
        self.entries: dict[tuple[int, int], dict[str, Any]] = {}

    def begin_group(self, layout: dict[str, Any]) -> dict[str, Any]:
        """A worker group of `layout` starts (asked by its rank 0). Returns its generation, the step it can reload
        (the newest complete one, if taken in the same layout, else None) and why not when None."""
        self.generation += 1
        newest = self._newest_complete()
        answer = {"generation": self.generation, "step": None, "why": "the holder has no complete step"}
        if newest is not None:
            held = self.entries[newest]
            if held["layout"] == layout_key(layout):
                answer.update(step=newest[1], source_generation=newest[0], why="")
            else:
                answer["why"] = f"its step {newest[1]} was taken in another layout ({held['layout']})"
        return answer

    def put(self, generation: int, rank: int, step: int, layout: dict[str, Any], shard: dict[str, Any]) -> bool:
        """Keep `rank`'s shard of `step`; False (nothing kept) if a newer worker group has started since."""
        if generation != self.generation:
            return False
        entry = self.entries.setdefault((generation, step), {"layout": layout_key(layout), "ranks": {}})
        entry["ranks"][rank] = owned_copy(shard)
        if len(entry["ranks"]) == senders(entry["layout"]):
            self._drop_older_than((generation, step))
        return True

    def get(self, source_generation: int, step: int, rank: int) -> dict[str, Any]:
        """What `rank` of a group in the held step's layout reloads (a replica: its stage's sender's shard)."""
        entry = self.entries[source_generation, step]
        return entry["ranks"][source_rank(entry["layout"], rank)]

    def held(self) -> dict[str, Any]:
        """What is held, without the tensors: (generation, step) -> ranks, and the bytes of tensors held."""
        return {"entries": {f"{g}/{s}": sorted(e["ranks"]) for (g, s), e in sorted(self.entries.items())},
                "bytes": sum(tensor_bytes(shard) for e in self.entries.values() for shard in e["ranks"].values())}

    def _newest_complete(self) -> tuple[int, int] | None:
        complete = [k for k, e in self.entries.items() if len(e["ranks"]) == senders(e["layout"])]
        return max(complete, default=None)

    def _drop_older_than(self, key: tuple[int, int]) -> None:
        for old in [k for k in self.entries if k < key]:
            del self.entries[old]


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
