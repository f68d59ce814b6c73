"""The measuring side of `raydl bench pipeline`: 2 gloo ranks spawned from the driver run raydl's own stages
of the benchmark model under every accepted (schedule, m) and time them (see raydl/bench/pipeline.py)."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from raydl.bench import harness
from raydl.bench.pipeline_model import (
    PP,
    Clock,
    SavedBytes,
    build_model,
    linear_loss,
    saved_bytes,
)
from raydl.bench.procs import free_port
from raydl.parallel.layout import Layout
from raydl.parallel.pipeline import pipeline_model


def run_ranks(settings: dict) -> dict[str, Any]:
    """{"p2p_latency_s", "by_rank": [rank 0's results, rank 1's]}, each rank's results one per config."""
    with tempfile.TemporaryDirectory(prefix="raydl-bench-pp-") as tmp:
        out = Path(tmp) / "result.json"
        port = free_port()
        mp.start_processes(_entry, args=(PP, port, settings, str(out)), nprocs=PP, start_method="spawn", join=True)
        return json.loads(out.read_text())


def _entry(rank: int, world_size: int, port: int, settings: dict, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=5))
    try:
        latency = _p2p_latency(rank)
        results = _measure_all(rank, settings)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, results)
        if rank == 0:
            Path(out_path).write_text(json.dumps({"p2p_latency_s": latency, "by_rank": gathered}))
    finally:
        dist.destroy_process_group()


def _p2p_latency(rank: int, rounds: int = 50) -> float:
    """One-way latency of a 1-element gloo send, median of `rounds` ping-pongs (for the planner's profile)."""
    t, times = torch.zeros(1), []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, dst=1)
            dist.recv(t, src=1)
        else:
            dist.recv(t, src=0)
            dist.send(t, dst=0)
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def _measure_all(rank: int, settings: dict) -> list[dict[str, Any]]:
    """All configs built up front, then timed alternately one step each (the harness's rounds), so that a
    burst of background load lands on every config alike instead of on whichever ran at the time."""
    runs = {f"{schedule} m={m}": _ConfigRun(rank, settings, schedule, m) for schedule, m in settings["configs"]}
    for run in runs.values():
        for _ in range(settings["warmup"]):
            run.step()
    timed = harness.alternate({key: run.step for key, run in runs.items()}, settings["repeats"], verbose=False)
    return [run.result(timed[key]) for key, run in runs.items()]


class _ConfigRun:
    """One (schedule, m) on this rank: raydl's stages of the 4-block model, fixed inputs and targets."""

    def __init__(self, rank: int, settings: dict, schedule: str, m: int):
        self.name, self.m, dim, batch = schedule, m, settings["dim"], settings["batch"]
        self.clock = Clock() if settings["mode"] == "sim" else None
        layout = Layout(world_size=PP, dp=1, pp=PP, micro_batch=batch // m, num_microbatches=m, schedule=schedule)
        self.schedule, self.stages, self.holder = pipeline_model(
            build_model(dim, self.clock, settings["cost_s"]), layout=layout, pp_rank=rank,
            pp_group=dist.group.WORLD, device=torch.device("cpu"), parallelize=lambda module: module,
            loss_fn=linear_loss)
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)

    def step(self) -> dict[str, float]:
        """Elapsed and compute seconds of one step on this rank."""
        self.holder.zero_grad(set_to_none=True)
        dist.barrier()
        busy0, t0 = self.clock.busy_s if self.clock else 0.0, time.perf_counter()
        _step(self.schedule, self.stages, self.x, self.y)
        elapsed = time.perf_counter() - t0
        if self.clock:
            return {"step_s": elapsed, "busy_s": self.clock.busy_s - busy0}
        dist.barrier()   # both ranks re-run at once, as both computed during the step
        return {"step_s": elapsed, "busy_s": _local_compute([s.submod for s in self.stages], self.x.tensor_split(self.m))}

    def result(self, timed: list[dict[str, float]]) -> dict[str, Any]:
        """The timed steps' numbers, then one more step for memory and pass counts."""
        before = dict(self.clock.counts) if self.clock else {}
        tracker = SavedBytes(exclude=self.holder.parameters())
        self.holder.zero_grad(set_to_none=True)
        dist.barrier()
        with tracker.hooks():
            _step(self.schedule, self.stages, self.x, self.y)
        counts = {kind: n - before[kind] for kind, n in self.clock.counts.items()} if self.clock else {}
        modules, chunk = [stage.submod for stage in self.stages], self.x.tensor_split(self.m)[0]
        return {"schedule": self.name, "m": self.m, "step_s": [t["step_s"] for t in timed],
                "busy_s": [t["busy_s"] for t in timed], "pass_counts": counts, "peak_saved_bytes": tracker.peak,
                "microbatch_saved_bytes": sum(saved_bytes(module, chunk) for module in modules),
                "block_saved_bytes": saved_bytes(next(iter(modules[0].blocks.values())), chunk),
                "blocks_on_rank": sum(len(module.blocks) for module in modules)}


def _step(schedule, stages, x: torch.Tensor, y: torch.Tensor) -> None:
    """One schedule step: inputs where the first stage is, targets where the last is."""
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    args = (x,) if first else ()
    schedule.step(*args, target=y if last else None, losses=[] if last else None)


def _local_compute(modules: list[nn.Module], chunks: tuple[torch.Tensor, ...]) -> float:
    """Seconds of forward and backward of this rank's stages on these micro-batches, no communication."""
    t0 = time.perf_counter()
    for module in modules:
        for chunk in chunks:
            out = module(chunk.detach().requires_grad_())
            out.backward(torch.ones_like(out))
    return time.perf_counter() - t0
