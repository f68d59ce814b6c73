"""Choose a data-parallel x pipeline-parallel layout from a per-block profile.

The model is an ordered list of blocks (embedding, N transformer blocks, head). A layout splits
``world_size`` workers into ``dp`` replicas of a ``pp``-rank pipeline, cuts the blocks into
``pp * stages_per_rank`` contiguous stages, and feeds each replica ``m = num_microbatches``
micro-batches of ``micro_batch`` samples per optimizer step. `plan` predicts step time and peak memory
of every candidate with the cost model below and picks the fastest layout that fits.

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
from dataclasses import dataclass, replace
from typing import Sequence

from raydl.errors import LayoutError
from raydl.parallel import schedules
from raydl.parallel.schedules import require_positive

__all__ = [
    "BlockProfile", "ModelProfile", "StagePrediction", "Candidate",
    "balanced_cuts", "check_mesh", "describe", "validate_layout", "validate_stage_cuts", "evaluate", "plan", "format_table",
]

_MIB = 2**20


@dataclass(frozen=True)
class BlockProfile:
    name: str
    fwd_s: float  # forward seconds for ONE micro-batch of `profile.micro_batch` samples
    bwd_s: float  # backward seconds (input grad + weight grad) for the same micro-batch
    param_bytes: int
    activation_bytes: int  # activation memory kept for backward per micro-batch
    output_bytes: int  # bytes of the block's output per micro-batch (what crosses a stage boundary)


@dataclass(frozen=True)
class ModelProfile:
    blocks: tuple[BlockProfile, ...]
    micro_batch: int  # samples per micro-batch the profile was measured at
    optimizer_bytes_per_param_byte: float = 2.0  # AdamW: 2 fp32 states per param
    p2p_bytes_per_s: float = 1e9  # link bandwidth between stages, for the communication term
    p2p_latency_s: float = 1e-4

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not self.blocks:
            raise LayoutError("the model profile has no blocks; profile at least one block")
        require_positive(micro_batch=self.micro_batch)


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


# ---------------------------------------------------------------------------------------------
# Partitioning


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


# ---------------------------------------------------------------------------------------------
# Validation


def validate_layout(
    *,
    num_blocks: int,
    world_size: int,
    pp: int,
    schedule: str,
    num_microbatches: int,
    global_batch: int,
    micro_batch: int,
    stage_cuts: Sequence[int] | None = None,
) -> None:
    """Raise LayoutError, with the numbers and the fix, for a layout torch or the batch sizes reject."""
    check_mesh(num_blocks, world_size, pp, schedule)
    _check_batch(world_size // pp, num_microbatches, global_batch, micro_batch)
    schedules.check_microbatches(schedule, pp, num_microbatches)
    if stage_cuts is not None:
        _check_cuts(tuple(stage_cuts), num_blocks, pp, schedule)


def validate_stage_cuts(stage_cuts: Sequence[int], *, num_blocks: int, pp: int, schedule: str) -> None:
    """Raise LayoutError for manual cuts that do not fit pp x stages-per-rank stages of num_blocks blocks."""
    _check_cuts(tuple(stage_cuts), num_blocks, pp, schedule)


def check_mesh(num_blocks: int, world_size: int, pp: int, schedule: str) -> None:
    per_rank = schedules.get(schedule).stages_per_rank
    require_positive(num_blocks=num_blocks, world_size=world_size, pp=pp)
    if world_size % pp:
        choices = ", ".join(str(d) for d in _divisors(world_size) if d <= num_blocks)
        raise LayoutError(f"world_size={world_size} is not divisible by pp={pp}; use pp in {{{choices}}}")
    if pp * per_rank > num_blocks:
        raise LayoutError(
            f"pp={pp} with schedule {schedule!r} needs {pp * per_rank} stages ({per_rank} per rank) but the "
            f"model has only {num_blocks} blocks; use pp <= {num_blocks // per_rank}"
        )


def _check_batch(dp: int, num_microbatches: int, global_batch: int, micro_batch: int) -> None:
    require_positive(global_batch=global_batch)
    if isinstance(micro_batch, int) and micro_batch < 1:
        raise LayoutError(
            f"micro_batch={micro_batch}: global_batch={global_batch} / dp={dp} / num_microbatches="
            f"{num_microbatches} leaves less than one sample per micro-batch; use num_microbatches <= "
            f"{global_batch // dp} or a larger global batch"
        )
    require_positive(micro_batch=micro_batch)
    if global_batch % (dp * micro_batch):
        step = dp * micro_batch
        raise LayoutError(
            f"global_batch={global_batch} is not divisible by dp*micro_batch = {dp}*{micro_batch} = {step}; "
            f"use a global batch that is a multiple of {step} (e.g. {math.ceil(global_batch / step) * step}) "
            f"or another micro-batch"
        )
    require_positive(num_microbatches=num_microbatches)
    per_replica = global_batch // dp
    if per_replica != num_microbatches * micro_batch:
        raise LayoutError(
            f"per-replica batch global_batch/dp = {global_batch}/{dp} = {per_replica} must equal "
            f"num_microbatches*micro_batch = {num_microbatches}*{micro_batch} = {num_microbatches * micro_batch}; "
            f"use num_microbatches={per_replica // micro_batch}"
        )


def _check_cuts(cuts: tuple[int, ...], num_blocks: int, pp: int, schedule: str) -> None:
    per_rank = schedules.get(schedule).stages_per_rank
    num_stages = pp * per_rank
    if len(cuts) != num_stages - 1:
        raise LayoutError(
            f"stage_cuts {cuts} has {len(cuts)} cuts but pp={pp} x {per_rank} stage(s) per rank for "
            f"{schedule!r} = {num_stages} stages need {num_stages - 1}"
        )
    for cut in cuts:
        if not isinstance(cut, int) or not 1 <= cut <= num_blocks - 1:
            raise LayoutError(f"stage_cuts {cuts}: cut {cut!r} is outside 1..{num_blocks - 1} ({num_blocks} blocks)")
    for i in range(1, len(cuts)):
        if cuts[i] <= cuts[i - 1]:
            raise LayoutError(
                f"stage_cuts {cuts} must be strictly increasing (every stage needs a block); "
                f"cut {cuts[i]} at position {i} follows {cuts[i - 1]}"
            )


# ---------------------------------------------------------------------------------------------
# Prediction


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
        reason=f"{verdict}: rank {fullest} needs {_mib(rank_memory[fullest])} MiB {relation} "
        f"{_mib(device_memory_bytes)} MiB device memory",
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


def _in_flight_chunks(schedule: str, pp: int, m: int, rank: int) -> int:
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
        in_flight = _in_flight_chunks(schedule, pp, m, ranks[stage]) / per_rank
        if checkpoint:
            kept = sum(b.output_bytes for b in blocks)
            transient = max(b.activation_bytes for b in blocks)
        else:
            kept, transient = sum(b.activation_bytes for b in blocks), 0
        memory.append(math.ceil(static + scale * (in_flight * kept + transient)))
    return memory


def _max_rank_memory(layout: Candidate) -> int:
    return max(_rank_sums(layout.schedule, layout.pp, [s.peak_memory_bytes for s in layout.stages]))


# ---------------------------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class _Request:
    """What to plan for; pp, schedule, num_microbatches and stage_cuts restrict the search when given."""
    world_size: int
    global_batch: int
    device_memory_bytes: int
    pp: int | str = "auto"
    schedule: str = "auto"
    num_microbatches: int | None = None
    stage_cuts: tuple[int, ...] | None = None
    allow_smaller_batch: bool = False


def plan(
    profile: ModelProfile,
    *,
    world_size: int,
    global_batch: int,
    device_memory_bytes: int,
    pp: int | str = "auto",
    schedule: str = "auto",
    num_microbatches: int | None = None,
    stage_cuts: Sequence[int] | None = None,
    allow_smaller_batch: bool = False,
) -> tuple[Candidate, list[Candidate]]:
    """Evaluate every candidate (pp over divisors of world_size up to the number of blocks, each
    schedule, every micro-batch count dividing the per-replica batch), restricted to the explicit
    arguments, and choose the fitting one with the lowest predicted step time (ties: smaller pp, then
    1f1b before gpipe, then fewer micro-batches, i.e. larger and more efficient ones).
    With `allow_smaller_batch` (an elastic run) a candidate whose dp does not divide the global batch
    trains the closest smaller one, as `mesh.batch_split` does; the largest global batch wins first.
    Returns (chosen, all candidates sorted: fitting first, best first)."""
    require_positive(world_size=world_size, global_batch=global_batch, device_memory_bytes=device_memory_bytes)
    request = _Request(world_size, global_batch, device_memory_bytes, pp, schedule, num_microbatches,
                       None if stage_cuts is None else tuple(stage_cuts), allow_smaller_batch)
    candidates, errors = _enumerate(profile, request)
    if not candidates:
        raise errors[0]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise _no_fit_error(profile, candidates, request)
    best = min(fitting, key=_rank_key)
    annotated = [_annotate(c, best, len(fitting), len(candidates), device_memory_bytes) for c in candidates]
    chosen = annotated[candidates.index(best)]
    return chosen, sorted(annotated, key=lambda c: (not c.fits, _rank_key(c)))


def _enumerate(profile: ModelProfile, request: _Request) -> tuple[list[Candidate], list[LayoutError]]:
    """All valid candidates, and the LayoutErrors of the combinations torch or the batch would reject."""
    num_blocks, world_size = len(profile.blocks), request.world_size
    pps = [d for d in _divisors(world_size) if d <= num_blocks] if request.pp == "auto" else [request.pp]
    candidates, errors = [], []
    for p in pps:
        for s in _schedules_for(request.schedule, p):
            try:
                check_mesh(num_blocks, world_size, p, s)
            except LayoutError as error:
                errors.append(error)
                continue
            per_replica = max(1, request.global_batch // (world_size // p))
            counts = [request.num_microbatches] if request.num_microbatches is not None else _divisors(per_replica)
            for m in counts:
                try:
                    candidates.append(evaluate(
                        profile, world_size=world_size, pp=p, schedule=s, global_batch=request.global_batch,
                        device_memory_bytes=request.device_memory_bytes, num_microbatches=m,
                        stage_cuts=request.stage_cuts, allow_smaller_batch=request.allow_smaller_batch,
                    ))
                except LayoutError as error:
                    errors.append(error)
    return candidates, errors


def _schedules_for(schedule: str, pp: int) -> tuple[str, ...]:
    if schedule != "auto":
        return (schedule,)
    # Without a pipeline every schedule is plain gradient accumulation: list it once.
    return ("1f1b",) if pp == 1 else schedules.NAMES


def _rank_key(candidate: Candidate) -> tuple:
    # Rounded to the nanosecond so float noise does not beat the tie-break.
    return (-candidate.global_batch, round(candidate.predicted_step_s, 9), candidate.pp,
            schedules.PREFERENCE.index(candidate.schedule), candidate.num_microbatches)


def _annotate(candidate: Candidate, best: Candidate, n_fit: int, n_all: int, device_memory_bytes: int) -> Candidate:
    if candidate == best:
        why = (f"chosen: lowest predicted step time ({1e3 * candidate.predicted_step_s:.1f} ms) of the {n_fit} "
               f"layouts that fit in {_mib(device_memory_bytes)} MiB ({n_all} evaluated)")
    elif not candidate.fits:
        why = candidate.reason
    elif candidate.global_batch < best.global_batch:
        why = f"fits, but trains a global batch of {candidate.global_batch} where the chosen keeps {best.global_batch}"
    elif _rank_key(candidate)[:2] == _rank_key(best)[:2]:
        why = "fits, same predicted time as the chosen; lost the tie-break (smaller pp, 1f1b, fewer micro-batches)"
    else:
        slower = candidate.predicted_step_s / best.predicted_step_s - 1
        why = f"fits, but predicted {100 * slower:.1f}% slower than the chosen layout"
    return replace(candidate, reason=why)


def _no_fit_error(profile: ModelProfile, candidates: list[Candidate], request: _Request) -> LayoutError:
    leanest = min(candidates, key=_max_rank_memory)
    lines = [
        f"no layout fits in {_mib(request.device_memory_bytes)} MiB per device with world_size={request.world_size} "
        f"and global_batch={request.global_batch}: the leanest ({describe(leanest)}) needs "
        f"{_mib(_max_rank_memory(leanest))} MiB on its fullest rank. What would fit:",
        _more_workers_hint(profile, request),
        _micro_batch_hint(profile, candidates, request),
        _checkpointing_hint(profile, leanest, request.device_memory_bytes),
    ]
    return LayoutError("\n  - ".join(lines))


def _more_workers_hint(profile: ModelProfile, request: _Request) -> str:
    """Search the smallest worker count, from the current one up, for which some pp fits (keeping the
    requested schedule and micro-batch count; pp is free because only pp splits the weights)."""
    floor = max(_block_floor(profile, b) for b in profile.blocks)
    if floor > request.device_memory_bytes:
        return (f"more workers: no number helps, one block alone needs {_mib(floor)} MiB "
                f"(params + grads + optimizer + activations of 1 sample)")
    num_blocks = len(profile.blocks)
    sizes = sorted({p * dp for p in range(1, num_blocks + 1) for dp in _divisors(request.global_batch)
                    if p * dp >= request.world_size})
    for size in sizes:
        best = _best_fitting(profile, replace(request, world_size=size, pp="auto", stage_cuts=None))
        if best and size == request.world_size:
            return f"more workers: not needed, the current {size} workers fit with {describe(best)}"
        if best:
            return f"more workers: {size} workers would fit ({describe(best)})"
    return f"more workers: none up to {sizes[-1] if sizes else request.world_size} workers fits"


def _best_fitting(profile: ModelProfile, request: _Request) -> Candidate | None:
    fitting = [c for c in _enumerate(profile, request)[0] if c.fits]
    return min(fitting, key=_rank_key) if fitting else None


def _block_floor(profile: ModelProfile, block: BlockProfile) -> float:
    static = block.param_bytes * (2 + profile.optimizer_bytes_per_param_byte)
    return static + block.activation_bytes / profile.micro_batch


def _micro_batch_hint(profile: ModelProfile, candidates: list[Candidate], request: _Request) -> str:
    if request.num_microbatches is None:
        sizes = sorted({c.micro_batch for c in candidates})
        return f"a smaller micro-batch: does not help, micro-batches of {sizes[0]}..{sizes[-1]} samples were all tried"
    best = _best_fitting(profile, replace(request, pp="auto", num_microbatches=None, stage_cuts=None))
    if best is None:
        return f"a smaller micro-batch: none fits on {request.world_size} workers"
    return f"a smaller micro-batch: micro_batch={best.micro_batch} fits ({describe(best)})"


def _checkpointing_hint(profile: ModelProfile, layout: Candidate, device_memory_bytes: int) -> str:
    bounds = _stage_bounds(layout.stage_cuts, len(profile.blocks))
    scale = layout.micro_batch / profile.micro_batch
    memory = _stage_memory(profile, layout.schedule, layout.pp, layout.num_microbatches, scale, bounds,
                           checkpoint=True)
    after = max(_rank_sums(layout.schedule, layout.pp, memory))
    before = _max_rank_memory(layout)
    extra = sum(b.fwd_s for b in profile.blocks) / sum(_block_costs(profile))
    verdict = "fits" if after <= device_memory_bytes else "still does not fit"
    return (f"activation checkpointing (keep block outputs, recompute in backward, ~{100 * extra:.0f}% more "
            f"compute): {describe(layout)} would drop from {_mib(before)} to {_mib(after)} MiB "
            f"(saves {_mib(before - after)} MiB), {verdict}")


# ---------------------------------------------------------------------------------------------
# Output


def format_table(candidates: list[Candidate], chosen: Candidate) -> str:
    """Plain-text table for `raydl plan`, chosen row marked with '*', then why it was chosen."""
    header = ("", "dp", "pp", "schedule", "m", "micro", "stage cuts", "step ms", "bubble %", "MiB/rank", "fits")
    rows = [header] + [_row(c, c == chosen) for c in candidates]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    text_columns = (0, 3, 6)
    lines = [
        "  ".join(cell.ljust(w) if i in text_columns else cell.rjust(w)
                  for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]
    lines.append(f"* {describe(chosen)}: {chosen.reason}")
    return "\n".join(lines)


def _row(layout: Candidate, is_chosen: bool) -> tuple[str, ...]:
    return (
        "*" if is_chosen else "",
        str(layout.dp),
        str(layout.pp),
        layout.schedule,
        str(layout.num_microbatches),
        str(layout.micro_batch),
        _format_cuts(layout.stage_cuts),
        f"{1e3 * layout.predicted_step_s:.1f}",
        f"{100 * layout.bubble_fraction:.1f}",
        f"{_mib(_max_rank_memory(layout))}",
        "yes" if layout.fits else "no",
    )


def _format_cuts(cuts: tuple[int, ...]) -> str:
    if not cuts:
        return "-"
    if len(cuts) <= 6:  # long cut lists (32-stage pipelines) would swamp the table
        return ",".join(map(str, cuts))
    return f"{cuts[0]},{cuts[1]},{cuts[2]},...,{cuts[-1]} ({len(cuts)} cuts)"


def describe(layout: Candidate) -> str:
    return (f"dp={layout.dp} pp={layout.pp} {layout.schedule} m={layout.num_microbatches} "
            f"micro_batch={layout.micro_batch}")


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / _MIB:,.1f}"


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
