"""Restart from memory: each rank with a part of the state of its own (replicas: one of them, see
`state_holder.senders`) hands its shard of the training state to the run's state holder
(`raydl.train.state_holder`, an actor on the driver's node) every checkpoint.memory_every_steps steps, and a
restarted worker group reloads it from there when it is newer than the last storage checkpoint.

The shard is what a DCP checkpoint holds for the rank (torch's `get_state_dict` of its part of the model and of
its optimizer: a pipeline stage's, an FSDP shard's, local tensors only), plus the step, the data position and the
scaler. The rank copies it to CPU memory after its optimizer step (the next step changes the parameters in place);
a thread of its own sends it and waits for the holder's answer, overlapping the next step. At most one shard is in
flight: the next copy waits for the previous send to finish.

At a worker-group start rank 0 asks the holder for the newest step every rank of the old group handed over
(`StateHolder.begin_group`) and broadcasts the answer, so every rank decides the same: reload that step if it was
taken in the same layout and is newer than the newest registered storage checkpoint, else read storage as before.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from raydl.train.optim import states_one_by_one
from raydl.train.state_holder import senders

log = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def cpu_copy(obj: Any) -> Any:
    """`obj` (a state dict) with every tensor replaced by a CPU copy of this rank's local part of it."""
    if isinstance(obj, torch.Tensor):
        return _local(obj).detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def copy_into(dst: Any, src: Any) -> Any:
    """`src`'s values written into `dst`'s tensors in place (as DCP loads: into the state dict of the model as laid
    out now); non-tensor values (hyperparameters, names) are taken from `src`."""
    if isinstance(dst, torch.Tensor):
        _local(dst).copy_(src)
        return dst
    if isinstance(dst, dict):
        if dst.keys() != src.keys():
            raise ValueError(f"held state has keys {sorted(src)[:5]}..., this rank's {sorted(dst)[:5]}...")
        return {k: copy_into(dst[k], src[k]) for k in dst}
    if isinstance(dst, (list, tuple)):
        return type(dst)(copy_into(d, s) for d, s in zip(dst, src, strict=True))
    return src


@torch.no_grad()
def take_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    with states_one_by_one(optimizer):
        msd, osd = get_state_dict(model, optimizer)
    return {"model": cpu_copy(msd), "optim": cpu_copy(osd)}


@torch.no_grad()
def load_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, shard: dict[str, Any]) -> None:
    with states_one_by_one(optimizer):   # the optimizer's states to write into
        msd, osd = get_state_dict(model, optimizer)
    set_state_dict(model, optimizer, model_state_dict=copy_into(msd, shard["model"]),
                   optim_state_dict=copy_into(osd, shard["optim"]))


@dataclass
class GroupStart:
    """What rank 0 learnt from the holder at this worker group's start, the same on every rank."""
    holder: Any
    generation: int
    step: int | None            # the newest complete held step reloadable into this layout, or None
    source_generation: int | None
    why: str                    # why `step` is None

    def newer_than(self, storage_step: int | None) -> bool:
        return self.step is not None and (storage_step is None or self.step > storage_step)

    def load(self, rank: int, model, optimizer, scaler) -> dict[str, Any]:
        """This rank's held shard loaded into `model`/`optimizer`/`scaler`; returns its trainer state."""
        import ray

        shard = ray.get(self.holder.get.remote(self.source_generation, self.step, rank))
        load_shard(model, optimizer, shard)
        if scaler and shard["scaler"]:
            scaler.load_state_dict(shard["scaler"])
        return shard["trainer"]


def begin_group(holder_name: str, rank: int, layout: dict[str, Any]) -> GroupStart:
    """Rank 0 claims the holder for this worker group; every rank gets its answer (a collective)."""
    import ray

    holder = ray.get_actor(holder_name)
    answer = [ray.get(holder.begin_group.remote(layout), timeout=60) if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    a = answer[0]
    return GroupStart(holder, a["generation"], a["step"], a.get("source_generation"), a["why"])


class MemoryKeeper:
    """Sends this rank's shard to the holder every `every` steps, from a thread of its own."""

    def __init__(self, group: GroupStart, *, rank: int, layout: dict[str, Any], every: int):
        self.group, self.rank, self.layout = group, rank, layout
        self.every = every if rank < senders(layout) else 0   # a replica: its stage's rank at dp rank 0 sends
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="raydl-memory-state")
        self._sent: Future | None = None

    def after_step(self, trainer_state: dict[str, Any], model, optimizer, scaler) -> None:
        """After the optimizer step of trainer_state["step"]: copy this rank's shard and send it (not waited for)."""
        if self.every == 0 or trainer_state["step"] % self.every:
            return
        self._wait()
        shard = {"trainer": trainer_state, "scaler": scaler.state_dict() if scaler else None,
                 **take_shard(model, optimizer)}
        self._sent = self._pool.submit(self._send, trainer_state["step"], shard)

    def _send(self, step: int, shard: dict[str, Any]) -> bool:
        import ray

        holder, g = self.group.holder, self.group.generation
        return ray.get(holder.put.remote(g, self.rank, step, self.layout, shard))

    def _wait(self) -> None:
        if self._sent is None:
            return
        try:
            self._sent.result()
        except Exception as e:   # the holder is gone (its node, the driver): storage checkpoints remain
            log.warning(f"restart from memory is off for the rest of this worker group: the state holder did not "
                        f"answer ({type(e).__name__}: {str(e)[:200]}); restarts read the last storage checkpoint")
            self.every = 0
        self._sent = None

    def close(self) -> None:
        self._wait()
        self._pool.shutdown(wait=True)
