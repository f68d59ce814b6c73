"""raydl bench pipeline: bubble, step time and activation memory of every pipeline schedule at p=2.

    raydl bench pipeline                        # simulated compute (default): holds on a loaded machine
    raydl bench pipeline --mode real --repeats 7

Two gloo processes spawned from this one run raydl's own stages (`pipeline_model`: the schedules of
torch.distributed.pipelining, real P2P of real activations) for p=2, m in {1, 2, 4, 8} and every
schedule torch accepts for (p, m). The model is 4 blocks of Linear(dim, dim) + GELU: gpipe and 1f1b
give each rank one stage of 2 blocks, the other schedules 2 stages of 1 block, so every rank does
the same work per micro-batch in every schedule.

Compute (--mode), as in shared/PIPELINE_NOTES.md 2a/2b
  sim   each block's forward (F), input-gradient (B) and weight-gradient (W) pass sleeps --cost-ms:
        F in the forward, B and W in autograd Functions on the activation and the weight path, so the
        zero-bubble schedules' split backward moves them as it moves real work. A sleep needs no free
        core, so a loaded machine barely changes the result; a late wake-up counts as compute (busy).
  real  the blocks' real matmuls; each rank's compute is timed by re-running its stages on the same
        micro-batches without communication right after each step. Noisy on a shared machine.
Per config: --warmup steps, then --repeats timed steps; medians are reported.
  step     barrier, schedule.step(); the longest of the two ranks
  busy     time in the sleeps (sim) or in the local re-run (real) on the busier rank
  bubble   1 - busy / step
  memory   one more step under autograd saved_tensors_hooks: peak live bytes of the tensors saved for
           backward on each rank (deduplicated by data pointer, parameters excluded), and that peak in
           micro-batches (divided by what one micro-batch through the rank's stages saves)
Beside them: (p-1)/(m+p-1) for gpipe/1f1b, and the planner's bubble, activation memory and step time
(`planner.evaluate` on a ModelProfile of the 4 blocks: F = 1 pass, backward = 2 passes, the measured
saved bytes per block and the measured P2P latency). The step time is predicted twice: from the
nominal pass cost (--cost-ms) and from the measured one (busier rank's compute / passes, which
includes oversleep; in real mode the only one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from raydl.bench.common import machine, write_result
from raydl.errors import ConfigError, LayoutError
from raydl.models.blocks import BlockModel
from raydl.parallel import planner, schedules
from raydl.parallel.mesh import Layout
from raydl.parallel.pipeline import pipeline_model
from raydl.parallel.schedules import stage_indices

PP = 2
NUM_BLOCKS = 4
FORMULA_SCHEDULES = tuple(s.name for s in schedules.SCHEDULES.values() if s.bubble_slots_per_microbatch == 1)
ZERO_BUBBLE = tuple(s.name for s in schedules.SCHEDULES.values() if s.zero_bubble)
FORMULA_TOLERANCE = 0.05   # goal: measured bubble within 5 percentage points of (p-1)/(m+p-1)
MEASURABLE = 0.02          # goal: a zero-bubble schedule's bubble at least 2 points below 1f1b's


# ---------------------------------------------------------------------------------------------
# Pure helpers (tests/unit/test_bench_pipeline.py)


def accepted_configs(schedules: Iterable[str], microbatches: Iterable[int], *, batch: int,
                     pp: int = PP) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """(schedule, m) pairs torch accepts for this pp, by the planner's copy of torch's checks; and why
    each other pair was skipped."""
    accepted, skipped = [], {}
    for schedule in schedules:
        for m in microbatches:
            try:
                planner.validate_layout(num_blocks=NUM_BLOCKS, world_size=pp, pp=pp, schedule=schedule,
                                        num_microbatches=m, global_batch=batch, micro_batch=batch // m)
                accepted.append((schedule, m))
            except LayoutError as error:
                skipped[f"{schedule} m={m}"] = str(error)
    return accepted, skipped


def formula_bubble(schedule: str, m: int, pp: int = PP) -> float | None:
    """(p-1)/(m+p-1), the GPipe/1F1B bubble; None for the schedules it does not describe."""
    return schedules.bubble_fraction(schedule, pp, m) if schedule in FORMULA_SCHEDULES else None


def per_step(step_by_rank: list[list[float]], busy_by_rank: list[list[float]]) -> dict[str, list[float]]:
    """Per timed step: step = slowest rank's elapsed time, busy = busiest rank's compute, bubble."""
    steps = [max(values) for values in zip(*step_by_rank)]
    busy = [max(values) for values in zip(*busy_by_rank)]
    return {"step_s": steps, "busy_s": busy, "bubble": [1 - b / s for b, s in zip(busy, steps)]}


def check_goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The three goals of issue 4's benchmark, each with the numbers it was decided on."""
    by_key = {(r["schedule"], r["m"]): r for r in rows}
    return {"formula_within_5_points": _formula_goal(rows), "zero_bubble_below_1f1b": _zero_bubble_goal(by_key),
            "1f1b_memory_below_gpipe": _memory_goal(by_key)}


def _formula_goal(rows: list[dict[str, Any]]) -> dict[str, Any]:
    checked = [{"schedule": r["schedule"], "m": r["m"], "measured": r["bubble"], "formula": r["formula_bubble"],
                "diff_points": 100 * (r["bubble"] - r["formula_bubble"])}
               for r in rows if r["formula_bubble"] is not None]
    within = all(abs(c["diff_points"]) <= 100 * FORMULA_TOLERANCE for c in checked)
    return {"pass": bool(checked) and within, "rows": checked}


def _zero_bubble_goal(by_key: dict[tuple[str, int], dict]) -> dict[str, Any]:
    checked = []
    for (schedule, m), r in by_key.items():
        base = by_key.get(("1f1b", m))
        if schedule in ZERO_BUBBLE and base:
            below = base["bubble"] - r["bubble"] >= MEASURABLE and r["step_s"] < base["step_s"]
            checked.append({"schedule": schedule, "m": m, "bubble": r["bubble"], "bubble_1f1b": base["bubble"],
                            "step_s": r["step_s"], "step_1f1b_s": base["step_s"], "below": below})
    rule = f"median bubble >= {100 * MEASURABLE:.0f} points below 1f1b's at the same m, and a lower median step"
    return {"pass": any(c["below"] for c in checked), "rule": rule, "rows": checked}


def _memory_goal(by_key: dict[tuple[str, int], dict]) -> dict[str, Any]:
    pairs = [(by_key[("gpipe", m)], r) for (schedule, m), r in sorted(by_key.items())
             if schedule == "1f1b" and m >= 4 and ("gpipe", m) in by_key]
    checked = [{"m": r["m"], "gpipe_peak_bytes": max(g["peak_saved_bytes"]),
                "1f1b_peak_bytes": max(r["peak_saved_bytes"])} for g, r in pairs]
    below = all(c["1f1b_peak_bytes"] < c["gpipe_peak_bytes"] for c in checked)
    return {"pass": bool(checked) and below, "rule": "busiest rank's peak saved bytes, m >= 4", "rows": checked}


_COLUMNS = (  # (header, cell)
    ("schedule", lambda r: r["schedule"]),
    ("m", lambda r: str(r["m"])),
    ("step ms", lambda r: f"{1e3 * r['step_s']:.0f}"),
    ("busiest-rank compute ms", lambda r: f"{1e3 * r['busy_s']:.0f}"),
    ("bubble measured", lambda r: f"{r['bubble']:.3f}"),
    ("(p−1)/(m+p−1)", lambda r: "—" if r["formula_bubble"] is None else f"{r['formula_bubble']:.3f}"),
    ("planner bubble", lambda r: f"{r['planner_bubble']:.3f}"),
    ("planner step ms", lambda r: f"{1e3 * r['planner_step_s']:.0f}"),
    ("step error %", lambda r: f"{r['step_error_pct']:+.1f}"),
    ("error %, measured pass", lambda r: f"{r['step_error_measured_pass_pct']:+.1f}"),
    ("peak saved KiB r0 / r1", lambda r: _pair(r["peak_saved_bytes"], 1 / 1024)),
    ("in flight (micro-batches) r0 / r1", lambda r: _pair(r["in_flight_microbatches"], 1)),
    ("planner KiB r0 / r1", lambda r: _pair(r["planner_activation_bytes"], 1 / 1024)),
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(head for head, _ in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(cell(r) for _, cell in _COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _pair(values: list[float], scale: float) -> str:
    return " / ".join(f"{v * scale:.1f}" for v in values)


class SavedBytes:
    """Live and peak bytes of the tensors autograd saves for backward, for a saved_tensors_hooks context.

    A tensor saved twice (same data pointer and size) counts once; parameters (`exclude`) do not count.
    Each packed tensor is wrapped in a handle whose release (autograd frees saved tensors after the
    backward that used them) subtracts its bytes again.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._skip = {t.data_ptr() for t in exclude}
        self._refs: dict[tuple[int, int], int] = {}
        self.current = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.data_ptr() in self._skip:
            return tensor
        return _Saved(self, tensor, (tensor.data_ptr(), tensor.numel() * tensor.element_size()))

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _add(self, key: tuple[int, int]) -> None:
        self._refs[key] = self._refs.get(key, 0) + 1
        if self._refs[key] == 1:
            self.current += key[1]
            self.peak = max(self.peak, self.current)

    def _remove(self, key: tuple[int, int]) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.current -= key[1]


class _Saved:
    __slots__ = ("tensor", "_owner", "_key")

    def __init__(self, owner: SavedBytes, tensor: torch.Tensor, key: tuple[int, int]):
        self.tensor, self._owner, self._key = tensor, owner, key
        owner._add(key)

    def __del__(self):
        self._owner._remove(self._key)


def sim_profile(*, cost_s: float, block_activation_bytes: int, micro_batch: int, dim: int,
                p2p_latency_s: float) -> planner.ModelProfile:
    """The planner's view of the benchmark model: F = cost, backward = B + W = 2 cost per block.
    Parameters are given 0 bytes, so the predicted memory is the activation memory alone."""
    block = planner.BlockProfile("b", fwd_s=cost_s, bwd_s=2 * cost_s, param_bytes=0,
                                 activation_bytes=block_activation_bytes, output_bytes=micro_batch * dim * 4)
    return planner.ModelProfile(blocks=(block,) * NUM_BLOCKS, micro_batch=micro_batch, p2p_latency_s=p2p_latency_s)


# ---------------------------------------------------------------------------------------------
# The model: blocks whose compute is real or simulated by sleeps


class Clock:
    """Seconds spent in simulated compute and the number of passes, by kind (F, B, W)."""

    def __init__(self):
        self.busy_s = 0.0
        self.counts = {"F": 0, "B": 0, "W": 0}

    def spend(self, kind: str, seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        self.busy_s += time.perf_counter() - t0   # the oversleep is the simulated compute's, not the bubble's
        self.counts[kind] += 1

    def __deepcopy__(self, memo):   # split_stages deep-copies the model; every stage keeps this clock
        return self


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: simulated backward work on the graph path it sits on."""

    @staticmethod
    def forward(ctx, x, clock: Clock, kind: str, seconds: float):
        ctx.clock, ctx.kind, ctx.seconds = clock, kind, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.spend(ctx.kind, ctx.seconds)
        return grad, None, None, None


class Block(nn.Module):
    """Linear + GELU. With a clock, each pass also sleeps `cost_s`: F in forward, B on the activation path
    (runs in a zero-bubble I step), W on the weight path (runs in its W step)."""

    def __init__(self, dim: int, clock: Clock | None = None, cost_s: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.clock, self.cost_s = clock, cost_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clock is None:
            return F.gelu(self.fc(x))
        self.clock.spend("F", self.cost_s)
        weight = _SleepInBackward.apply(self.fc.weight, self.clock, "W", self.cost_s)
        h = _SleepInBackward.apply(F.linear(x, weight, self.fc.bias), self.clock, "B", self.cost_s)
        return F.gelu(h)


def linear_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Saves nothing for backward (sub and mean need no inputs), so the memory measured is the blocks'.
    return (out - target).mean()


def build_model(dim: int, clock: Clock | None, cost_s: float) -> BlockModel:
    torch.manual_seed(0)
    return BlockModel({f"b{i}": Block(dim, clock, cost_s) for i in range(NUM_BLOCKS)})


# ---------------------------------------------------------------------------------------------
# Worker side: 2 gloo ranks


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
    """All configs built up front, then timed in rounds of one step each, so that a burst of background
    load lands on every config alike instead of on whichever ran at the time."""
    runs = [_ConfigRun(rank, settings, schedule, m) for schedule, m in settings["configs"]]
    for run in runs:
        for _ in range(settings["warmup"]):
            run.step()
    timed = [[run.step() for run in runs] for _ in range(settings["repeats"])]
    return [run.result(column) for run, column in zip(runs, zip(*timed))]


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

    def step(self) -> tuple[float, float, tuple[float, float]]:
        """(elapsed s, compute s, local (forward s, backward s)) of one step on this rank."""
        self.holder.zero_grad(set_to_none=True)
        dist.barrier()
        busy0, t0 = self.clock.busy_s if self.clock else 0.0, time.perf_counter()
        _step(self.schedule, self.stages, self.x, self.y)
        elapsed = time.perf_counter() - t0
        if self.clock:
            return elapsed, self.clock.busy_s - busy0, (0.0, 0.0)
        dist.barrier()   # both ranks re-run at once, as both computed during the step
        fwd, bwd = _local_compute([stage.submod for stage in self.stages], self.x.tensor_split(self.m))
        return elapsed, fwd + bwd, (fwd, bwd)

    def result(self, timed: Iterable[tuple[float, float, tuple[float, float]]]) -> dict[str, Any]:
        """The timed steps' numbers, then one more step for memory and pass counts."""
        step_s, busy_s, local = (list(column) for column in zip(*timed))
        before = dict(self.clock.counts) if self.clock else {}
        tracker = SavedBytes(exclude=self.holder.parameters())
        self.holder.zero_grad(set_to_none=True)
        dist.barrier()
        with tracker.hooks():
            _step(self.schedule, self.stages, self.x, self.y)
        counts = {kind: n - before[kind] for kind, n in self.clock.counts.items()} if self.clock else {}
        modules, chunk = [stage.submod for stage in self.stages], self.x.tensor_split(self.m)[0]
        return {"schedule": self.name, "m": self.m, "step_s": step_s, "busy_s": busy_s, "pass_counts": counts,
                "local_fwd_bwd_s": local, "peak_saved_bytes": tracker.peak,
                "microbatch_saved_bytes": sum(_saved_bytes(module, chunk) for module in modules),
                "block_saved_bytes": _saved_bytes(next(iter(modules[0].blocks.values())), chunk),
                "blocks_on_rank": sum(len(module.blocks) for module in modules)}


def _step(schedule, stages, x: torch.Tensor, y: torch.Tensor) -> None:
    """One schedule step: inputs where the first stage is, targets where the last is."""
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    args = (x,) if first else ()
    schedule.step(*args, target=y if last else None, losses=[] if last else None)


def _local_compute(modules: list[nn.Module], chunks: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """(forward s, backward s) of this rank's stages on these micro-batches, no communication."""
    fwd = bwd = 0.0
    for module in modules:
        for chunk in chunks:
            t0 = time.perf_counter()
            out = module(chunk.detach().requires_grad_())
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
    return fwd, bwd


def _saved_bytes(module: nn.Module, chunk: torch.Tensor) -> int:
    """Bytes one micro-batch through `module` saves for backward."""
    tracker = SavedBytes(exclude=module.parameters())
    with tracker.hooks():
        module(chunk.detach())   # the output is dropped at once: its graph and saved tensors go with it
    return tracker.peak


# ---------------------------------------------------------------------------------------------
# Driver side


def run_workers(settings: dict) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="raydl-bench-pp-") as tmp:
        out = Path(tmp) / "result.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_entry, args=(PP, port, settings, str(out)), nprocs=PP, start_method="spawn", join=True)
        return json.loads(out.read_text())


def summarize(raw: dict[str, Any], settings: dict) -> list[dict[str, Any]]:
    """One row per config: medians of the timed steps, memory per rank, the formula and the planner."""
    rows = []
    for by_rank in zip(*raw["by_rank"]):
        first = by_rank[0]
        schedule, m = first["schedule"], first["m"]
        steps = per_step([r["step_s"] for r in by_rank], [r["busy_s"] for r in by_rank])
        row = {"schedule": schedule, "m": m, **{k: statistics.median(v) for k, v in steps.items()},
               "per_step": steps, "pass_counts_by_rank": [r["pass_counts"] for r in by_rank],
               "peak_saved_bytes": [r["peak_saved_bytes"] for r in by_rank],
               "microbatch_saved_bytes": [r["microbatch_saved_bytes"] for r in by_rank],
               "in_flight_microbatches": [r["peak_saved_bytes"] / r["microbatch_saved_bytes"] for r in by_rank],
               "formula_bubble": formula_bubble(schedule, m)}
        row.update(_planner_columns(row, by_rank, settings, raw["p2p_latency_s"]))
        rows.append(row)
    return rows


def _planner_columns(row: dict, by_rank: tuple[dict, ...], settings: dict, latency: float) -> dict[str, Any]:
    """The planner's bubble, activation memory per rank and step time for this config. Step time twice:
    from the nominal pass cost (sim: --cost-ms) and from the measured one (busier rank's compute per
    pass, which in sim mode includes the sleeps' oversleep); real mode has only the measured one."""
    measured = _measured_pass_s(by_rank, row["m"])
    nominal = _evaluate(row, by_rank, settings, latency, settings["cost_s"] or measured)
    fitted = _evaluate(row, by_rank, settings, latency, measured)
    per_rank = [sum(nominal.stages[i].peak_memory_bytes for i in stage_indices(row["schedule"], PP, r))
                for r in range(PP)]
    return {"planner_bubble": nominal.bubble_fraction, "planner_activation_bytes": per_rank,
            "pass_s_nominal": settings["cost_s"] or measured, "pass_s_measured": measured,
            "planner_step_s": nominal.predicted_step_s,
            "step_error_pct": 100 * (nominal.predicted_step_s / row["step_s"] - 1),
            "planner_step_measured_pass_s": fitted.predicted_step_s,
            "step_error_measured_pass_pct": 100 * (fitted.predicted_step_s / row["step_s"] - 1)}


def _evaluate(row: dict, by_rank: tuple[dict, ...], settings: dict, latency: float, pass_s: float) -> planner.Layout:
    profile = sim_profile(cost_s=pass_s, block_activation_bytes=by_rank[0]["block_saved_bytes"],
                          micro_batch=settings["batch"] // row["m"], dim=settings["dim"], p2p_latency_s=latency)
    return planner.evaluate(profile, world_size=PP, pp=PP, schedule=row["schedule"], global_batch=settings["batch"],
                            device_memory_bytes=2**40, num_microbatches=row["m"])


def _measured_pass_s(by_rank: tuple[dict, ...], m: int) -> float:
    """Seconds of one pass (F, B or W) of one block on one micro-batch: the median compute per step of
    the busier rank over its 3 passes x m micro-batches x blocks."""
    return max(statistics.median(r["busy_s"]) / (3 * m * r["blocks_on_rank"]) for r in by_rank)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raydl bench pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("sim", "real"), default="sim", help="Simulated (sleep) or real compute.")
    p.add_argument("--repeats", type=int, default=5, help="Timed steps per config (medians are reported).")
    p.add_argument("--warmup", type=int, default=2, help="Untimed steps per config before the timed ones.")
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=list(schedules.NAMES), choices=schedules.NAMES)
    p.add_argument("--cost-ms", type=float, default=20.0,
                   help="sim: sleep per pass (F, B, W) per block; a rank does 6 per micro-batch.")
    p.add_argument("--dim", type=int, default=None, help="Block width (default 64 sim, 1024 real).")
    p.add_argument("--batch", type=int, default=None, help="Samples per step (default 64 sim, 256 real).")
    p.add_argument("--out", default="benchmarks/results/pipeline-cpu.json")
    args = p.parse_args(argv)
    settings = _settings(args)
    t0, info = time.perf_counter(), machine()
    raw = run_workers(settings)
    rows = summarize(raw, settings)
    goals = check_goals(rows)
    _report(rows, goals, raw["p2p_latency_s"])
    info["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    write_result(args.out, {"machine": info, "method": __doc__, "settings": settings,
                            "p2p_latency_s": raw["p2p_latency_s"], "rows": rows, "goals": goals,
                            "planner_step_error_pct": _error_summary(rows), "wall_s": time.perf_counter() - t0})
    return 0


def _settings(args) -> dict[str, Any]:
    if args.repeats < 1 or args.warmup < 0:
        raise ConfigError("--repeats/--warmup", f"are {args.repeats}/{args.warmup}",
                          "use --repeats >= 1 and --warmup >= 0")
    sim = args.mode == "sim"
    batch = args.batch or (64 if sim else 256)
    bad = [m for m in args.microbatches if m < 1 or batch % m]
    if bad:
        raise ConfigError("--microbatches", f"has {bad}, which do not divide --batch={batch}",
                          f"use divisors of {batch} (e.g. 1 2 4 8)")
    if sim and args.cost_ms <= 0:
        raise ConfigError("--cost-ms", f"is {args.cost_ms}", "use a positive sleep per pass, e.g. 20")
    configs, skipped = accepted_configs(args.schedules, args.microbatches, batch=batch)
    if not configs:
        raise ConfigError("--schedules/--microbatches", f"leave no pair torch accepts at pp={PP}: "
                          + "; ".join(skipped.values()), "add micro-batch counts or schedules")
    return {"mode": args.mode, "pp": PP, "repeats": args.repeats, "warmup": args.warmup, "batch": batch,
            "dim": args.dim or (64 if sim else 1024), "cost_s": args.cost_ms / 1e3 if sim else 0.0,
            "configs": configs, "skipped": skipped}


def _error_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    summary = {}
    for key in ("step_error_pct", "step_error_measured_pass_pct"):
        errors = [abs(r[key]) for r in rows]
        summary[key] = {"median_abs": statistics.median(errors), "max_abs": max(errors)}
    return summary


def _report(rows: list[dict[str, Any]], goals: dict[str, Any], latency: float) -> None:
    print(markdown_table(rows))
    errors = _error_summary(rows)
    print(f"\nP2P latency {1e6 * latency:.0f} us. Planner step-time error, median |err| (max): "
          f"nominal pass cost {errors['step_error_pct']['median_abs']:.1f}% "
          f"({errors['step_error_pct']['max_abs']:.1f}%), measured pass cost "
          f"{errors['step_error_measured_pass_pct']['median_abs']:.1f}% "
          f"({errors['step_error_measured_pass_pct']['max_abs']:.1f}%)")
    for name, goal in goals.items():
        print(f"goal {name}: {'PASS' if goal['pass'] else 'FAIL'}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
