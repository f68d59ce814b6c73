"""The cost model: step time, bubble and memory of a data-parallel x pipeline-parallel layout.

The model is an ordered list of blocks (embedding, N transformer blocks, head). A layout splits
``world_size`` workers into ``dp`` replicas of a ``pp``-rank pipeline, cuts the blocks into
``pp * stages_per_rank`` contiguous stages, and feeds each replica ``m = num_microbatches``
micro-batches of ``micro_batch`` samples per optimizer step. `evaluate` predicts the step time and peak
memory of one such candidate with the cost model below; `raydl.parallel.search` picks among them.

Cost model (per data-parallel replica; replicas run side by side)
------------------------------------------------------------------
Scaling
    Block times and activation bytes were measured at ``b0 = profile.micro_batch`` samples and scale
    linearly with the micro-batch ``b``: ``t(b) = t(b0) * b / b0``. Real kernels lose efficiency on
    small micro-batches, so the model is optimistic far below ``b0``: profile near the size you run.
Stage and rank time per micro-batch
    ``t_stage = sum(fwd_s + bwd_s)`` over the stage's blocks; a rank runs 1 stage (gpipe, 1f1b) or 2.
    Each stage boundary between two ranks moves the boundary block's output forward and its gradient
    back, ``c = 2 * (p2p_latency_s + output_bytes / p2p_bytes_per_s)`` per micro-batch. Both ranks at the
    boundary wait for both transfers (no compute/communication overlap: gloo P2P blocks, and torch runs
    DualPipeV's overlapped F&B one after the other), so ``c`` is added to both ranks.
    ``T_rank = sum(t_stage of its stages) + sum(c of its cross-rank boundaries)``.
Step time
    ``step = m * max(T_rank) / (1 - bubble)``; for gpipe/1f1b that is ``(m + p - 1) * max(T_rank)``,
    the GPipe formula. The data-parallel gradient all-reduce is not modelled (it overlaps backward).
Bubble (idle share of the step, p = pp, m micro-batches)
    ``(p-1)/(k*m+p-1)`` with k slots per micro-batch from the schedule table, `schedules.bubble_fraction`:
    gpipe/1f1b (p-1)/(m+p-1), loopedbfs/interleaved1f1b k=2, interleavedzb k=3, zbv/dualpipev k=4.
Memory per rank
    params + grads (= params) + optimizer states (``optimizer_bytes_per_param_byte * params``) +
    activations kept for backward. No sharding over dp is assumed (conservative for FSDP2).
    In-flight activations per rank, counted in chunks (one stage x one micro-batch) by replaying the
    schedule tables of torch 2.13 ``torch.distributed.pipelining.schedules`` (rank r, v = 2, ``hops`` =
    p - 1 - r, ``per_round`` = m // max(1, m // p)):
        gpipe m;  1f1b min(m, p - r);  loopedbfs v*m;
        interleaved1f1b min(v*m, per_round + 2*hops + 1);  interleavedzb min(v*m, per_round + hops + 1);
        zbv min(v*m, 2p, m + 1 + r);  dualpipev min(v*m, 2p + 1).
    A stage keeps ``chunks / stages_per_rank`` micro-batches of its own activations (the rank's chunks
    split evenly between its stages, an approximation). A layout fits if every rank's total is at most
    the device memory. pp = 1 (no pipeline, plain gradient accumulation) is listed as 1f1b, whose rule
    gives the one micro-batch in flight that accumulation keeps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from raydl.errors import LayoutError
from raydl.parallel import schedules
from raydl.parallel.constraints import check_mesh, validate_layout
from raydl.parallel.profile import BlockProfile, ModelProfile
from raydl.parallel.schedules import require_positive

__all__ = ["StagePrediction", "Candidate", "balanced_cuts", "evaluate", "max_rank_memory", "in_flight_chunks",
           "checkpointed_max_rank_memory", "recompute_share", "block_floor_bytes", "mib"]

_MIB = 2**20


@dataclass(frozen=True)
class StagePrediction:
    blocks: tuple[int, int]  # [start, end) block indices
    compute_s: float  # per step (all micro-batches) fwd+bwd
    peak_memory_bytes: int  # params + grads + optimizer + this stage's share of in-flight activations


@dataclass(frozen=True)
class Candidate:
    dp: int
    pp: int
    schedule: str
    num_microbatches: int  # per data-parallel replica per optimizer step (= accumulation when pp == 1)
    micro_batch: int
    stage_cuts: tuple[int, ...]  # block index where each stage after the first begins
    stages: tuple[StagePrediction, ...]
    predicted_step_s: float
    bubble_fraction: float
    fits: bool  # every rank's peak memory (sum of its stages) <= device memory
    reason: str  # one line: why chosen / why rejected

    @property
    def global_batch(self) -> int:
        return self.dp * self.num_microbatches * self.micro_batch


def balanced_cuts(costs: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Contiguous partition of `costs` into num_stages non-empty parts minimising the maximum part
    sum (exact dynamic programme); returns the start indices of parts 2..n."""
    if not isinstance(num_stages, int) or not 1 <= num_stages <= len(costs):
        raise LayoutError(
            f"cannot cut {len(costs)} blocks into {num_stages} non-empty stages; use 1..{len(costs)} stages"
        )
    return _balanced_cuts(tuple(float(c) for c in costs), num_stages)


@functools.lru_cache(maxsize=256)
def _balanced_cuts(costs: tuple[float, ...], k: int) -> tuple[int, ...]:
    # Cached because plan() asks for the same stage count with many schedules and micro-batch counts.
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[j][i]: smallest max part sum of costs[:i] in j parts; start[j][i]: where the j-th part begins.
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    start = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                value = max(best[j - 1][s], prefix[i] - prefix[s])
                if value < best[j][i]:
                    best[j][i], start[j][i] = value, s
    cuts, i = [], n
    for j in range(k, 1, -1):
        i = start[j][i]
        cuts.append(i)
    return tuple(reversed(cuts))


def evaluate(
    profile: ModelProfile,
    *,
    world_size: int,
    pp: int,
    schedule: str,
    global_batch: int,
    device_memory_bytes: int,
    num_microbatches: int | None = None,
    stage_cuts: Sequence[int] | None = None,
    allow_smaller_batch: bool = False,
) -> Candidate:
    """Predict one layout (validated first). Without num_microbatches the micro-batch is the profiled
    one; with it, micro_batch = global_batch // dp // num_microbatches. Without stage_cuts the blocks
    are cut by `balanced_cuts` on fwd+bwd time. With `allow_smaller_batch` a global batch that does not
    split into dp x m x micro_batch becomes the closest smaller one that does."""
    num_blocks = len(profile.blocks)
    check_mesh(num_blocks, world_size, pp, schedule)
    require_positive(global_batch=global_batch)
    dp = world_size // pp
    if num_microbatches is None:
        micro_batch = profile.micro_batch
        num_microbatches = global_batch // dp // micro_batch
    else:
        require_positive(num_microbatches=num_microbatches)
        micro_batch = global_batch // dp // num_microbatches
    if allow_smaller_batch and micro_batch >= 1:
        global_batch = dp * num_microbatches * micro_batch
    validate_layout(
        num_blocks=num_blocks, world_size=world_size, pp=pp, schedule=schedule, num_microbatches=num_microbatches,
        global_batch=global_batch, micro_batch=micro_batch, stage_cuts=stage_cuts,
    )
    num_stages = pp * schedules.get(schedule).stages_per_rank
    cuts = tuple(stage_cuts) if stage_cuts is not None else balanced_cuts(_block_costs(profile), num_stages)
    return _predict(profile, dp, pp, schedule, num_microbatches, micro_batch, cuts, device_memory_bytes)


def _predict(
    profile: ModelProfile, dp: int, pp: int, schedule: str, m: int, micro_batch: int,
    cuts: tuple[int, ...], device_memory_bytes: int,
) -> Candidate:
    scale = micro_batch / profile.micro_batch
    bounds = _stage_bounds(cuts, len(profile.blocks))
    costs = _block_costs(profile)
    stage_times = [scale * sum(costs[a:e]) for a, e in bounds]
    rank_times = _rank_times(profile, schedule, pp, bounds, stage_times, scale)
    bubble = schedules.bubble_fraction(schedule, pp, m)
    memory = _stage_memory(profile, schedule, pp, m, scale, bounds, checkpoint=False)
    stages = tuple(
        StagePrediction(blocks=b, compute_s=m * t, peak_memory_bytes=mem)
        for b, t, mem in zip(bounds, stage_times, memory)
    )
    rank_memory = _rank_sums(schedule, pp, memory)
    fullest = max(range(pp), key=rank_memory.__getitem__)
    fits = rank_memory[fullest] <= device_memory_bytes
    verdict = "fits" if fits else "does not fit"
    relation = "<=" if fits else ">"
    return Candidate(
        dp=dp, pp=pp, schedule=schedule, num_microbatches=m, micro_batch=micro_batch, stage_cuts=cuts,
        stages=stages, predicted_step_s=m * max(rank_times) / (1 - bubble), bubble_fraction=bubble, fits=fits,
        reason=f"{verdict}: rank {fullest} needs {mib(rank_memory[fullest])} MiB {relation} "
        f"{mib(device_memory_bytes)} MiB device memory",
    )


def _block_costs(profile: ModelProfile) -> tuple[float, ...]:
    return tuple(b.fwd_s + b.bwd_s for b in profile.blocks)


def _stage_bounds(cuts: tuple[int, ...], num_blocks: int) -> tuple[tuple[int, int], ...]:
    edges = (0, *cuts, num_blocks)
    return tuple(zip(edges[:-1], edges[1:]))


def _rank_sums(schedule: str, pp: int, per_stage: Sequence[float]) -> list[float]:
    totals = [0] * pp
    for rank, value in zip(schedules.stage_ranks(schedule, pp), per_stage):
        totals[rank] += value
    return totals


def _rank_times(
    profile: ModelProfile, schedule: str, pp: int, bounds: tuple[tuple[int, int], ...],
    stage_times: list[float], scale: float,
) -> list[float]:
    """Seconds per micro-batch on each rank: its stages' compute plus the transfers it waits for."""
    times = _rank_sums(schedule, pp, stage_times)
    ranks = schedules.stage_ranks(schedule, pp)
    for s in range(len(bounds) - 1):
        if ranks[s] == ranks[s + 1]:
            continue  # the V turn (stages pp-1 and pp) stays on one rank: no transfer
        out_bytes = scale * profile.blocks[bounds[s][1] - 1].output_bytes
        transfer = 2 * (profile.p2p_latency_s + out_bytes / profile.p2p_bytes_per_s)
        times[ranks[s]] += transfer
        times[ranks[s + 1]] += transfer
    return times


def in_flight_chunks(schedule: str, pp: int, m: int, rank: int) -> int:
    """Peak (stage, micro-batch) activation sets a rank holds, read off torch 2.13's schedule tables."""
    hops = pp - 1 - rank  # earlier ranks warm up with more forwards before their first backward
    per_round = m // max(1, m // pp)  # torch's microbatches_per_round
    v = schedules.get(schedule).stages_per_rank
    rules = {
        "gpipe": m,
        "1f1b": min(m, pp - rank),
        "loopedbfs": v * m,
        "interleaved1f1b": min(v * m, per_round + 2 * hops + 1),
        "interleavedzb": min(v * m, per_round + hops + 1),
        "zbv": min(v * m, 2 * pp, m + 1 + rank),
        "dualpipev": min(v * m, 2 * pp + 1),
    }
    return rules[schedule]


def _stage_memory(
    profile: ModelProfile, schedule: str, pp: int, m: int, scale: float,
    bounds: tuple[tuple[int, int], ...], *, checkpoint: bool,
) -> list[int]:
    """Peak bytes per stage. With activation checkpointing a stage keeps only its blocks' outputs per
    micro-batch in flight, plus one block's full activations while that block is recomputed."""
    ranks = schedules.stage_ranks(schedule, pp)
    per_rank = schedules.get(schedule).stages_per_rank
    memory = []
    for stage, (a, e) in enumerate(bounds):
        blocks = profile.blocks[a:e]
        params = sum(b.param_bytes for b in blocks)
        static = params * (2 + profile.optimizer_bytes_per_param_byte)  # params + grads + optimizer
        in_flight = in_flight_chunks(schedule, pp, m, ranks[stage]) / per_rank
        if checkpoint:
            kept = sum(b.output_bytes for b in blocks)
            transient = max(b.activation_bytes for b in blocks)
        else:
            kept, transient = sum(b.activation_bytes for b in blocks), 0
        memory.append(math.ceil(static + scale * (in_flight * kept + transient)))
    return memory


def max_rank_memory(candidate: Candidate) -> int:
    return max(_rank_sums(candidate.schedule, candidate.pp, [s.peak_memory_bytes for s in candidate.stages]))


def checkpointed_max_rank_memory(profile: ModelProfile, candidate: Candidate) -> int:
    """The fullest rank's peak bytes if the candidate ran with activation checkpointing."""
    bounds = _stage_bounds(candidate.stage_cuts, len(profile.blocks))
    scale = candidate.micro_batch / profile.micro_batch
    memory = _stage_memory(profile, candidate.schedule, candidate.pp, candidate.num_microbatches, scale, bounds,
                           checkpoint=True)
    return max(_rank_sums(candidate.schedule, candidate.pp, memory))


def recompute_share(profile: ModelProfile) -> float:
    """Extra compute of activation checkpointing: one more forward per fwd+bwd."""
    return sum(b.fwd_s for b in profile.blocks) / sum(_block_costs(profile))


def block_floor_bytes(profile: ModelProfile, block: BlockProfile) -> float:
    """One block alone at one sample: params + grads + optimizer states + activations."""
    static = block.param_bytes * (2 + profile.optimizer_bytes_per_param_byte)
    return static + block.activation_bytes / profile.micro_batch


def mib(num_bytes: float) -> str:
    return f"{num_bytes / _MIB:,.1f}"
