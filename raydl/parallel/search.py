"""Choose a data-parallel x pipeline-parallel layout: enumerate the candidates, predict each with the
cost model (`raydl.parallel.cost_model`), pick the fastest that fits, and say what would fit when none does.

    raydl plan --workers 4        # the table `format_table` prints
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from raydl.errors import LayoutError
from raydl.parallel import schedules
from raydl.parallel.constraints import check_mesh, divisors
from raydl.parallel.cost_model import (Candidate, block_floor_bytes, checkpointed_max_rank_memory, evaluate,
                                       max_rank_memory, mib, recompute_share)
from raydl.parallel.profile import ModelProfile
from raydl.parallel.schedules import require_positive

__all__ = ["plan", "format_table", "describe"]


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
    trains the closest smaller one, as `batching.batch_split` does; the largest global batch wins first.
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
    pps = [d for d in divisors(world_size) if d <= num_blocks] if request.pp == "auto" else [request.pp]
    candidates, errors = [], []
    for p in pps:
        for s in _schedules_for(request.schedule, p):
            try:
                check_mesh(num_blocks, world_size, p, s)
            except LayoutError as error:
                errors.append(error)
                continue
            per_replica = max(1, request.global_batch // (world_size // p))
            counts = [request.num_microbatches] if request.num_microbatches is not None else divisors(per_replica)
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
               f"layouts that fit in {mib(device_memory_bytes)} MiB ({n_all} evaluated)")
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
    leanest = min(candidates, key=max_rank_memory)
    lines = [
        f"no layout fits in {mib(request.device_memory_bytes)} MiB per device with world_size={request.world_size} "
        f"and global_batch={request.global_batch}: the leanest ({describe(leanest)}) needs "
        f"{mib(max_rank_memory(leanest))} MiB on its fullest rank. What would fit:",
        _more_workers_hint(profile, request),
        _micro_batch_hint(profile, candidates, request),
        _checkpointing_hint(profile, leanest, request.device_memory_bytes),
    ]
    return LayoutError("\n  - ".join(lines))


def _more_workers_hint(profile: ModelProfile, request: _Request) -> str:
    """Search the smallest worker count, from the current one up, for which some pp fits (keeping the
    requested schedule and micro-batch count; pp is free because only pp splits the weights)."""
    floor = max(block_floor_bytes(profile, b) for b in profile.blocks)
    if floor > request.device_memory_bytes:
        return (f"more workers: no number helps, one block alone needs {mib(floor)} MiB "
                f"(params + grads + optimizer + activations of 1 sample)")
    num_blocks = len(profile.blocks)
    sizes = sorted({p * dp for p in range(1, num_blocks + 1) for dp in divisors(request.global_batch)
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


def _micro_batch_hint(profile: ModelProfile, candidates: list[Candidate], request: _Request) -> str:
    if request.num_microbatches is None:
        sizes = sorted({c.micro_batch for c in candidates})
        return f"a smaller micro-batch: does not help, micro-batches of {sizes[0]}..{sizes[-1]} samples were all tried"
    best = _best_fitting(profile, replace(request, pp="auto", num_microbatches=None, stage_cuts=None))
    if best is None:
        return f"a smaller micro-batch: none fits on {request.world_size} workers"
    return f"a smaller micro-batch: micro_batch={best.micro_batch} fits ({describe(best)})"


def _checkpointing_hint(profile: ModelProfile, candidate: Candidate, device_memory_bytes: int) -> str:
    after, before = checkpointed_max_rank_memory(profile, candidate), max_rank_memory(candidate)
    verdict = "fits" if after <= device_memory_bytes else "still does not fit"
    extra = recompute_share(profile)
    return (f"activation checkpointing (keep block outputs, recompute in backward, ~{100 * extra:.0f}% more "
            f"compute): {describe(candidate)} would drop from {mib(before)} to {mib(after)} MiB "
            f"(saves {mib(before - after)} MiB), {verdict}")


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


def _row(candidate: Candidate, is_chosen: bool) -> tuple[str, ...]:
    return (
        "*" if is_chosen else "",
        str(candidate.dp),
        str(candidate.pp),
        candidate.schedule,
        str(candidate.num_microbatches),
        str(candidate.micro_batch),
        _format_cuts(candidate.stage_cuts),
        f"{1e3 * candidate.predicted_step_s:.1f}",
        f"{100 * candidate.bubble_fraction:.1f}",
        f"{mib(max_rank_memory(candidate))}",
        "yes" if candidate.fits else "no",
    )


def _format_cuts(cuts: tuple[int, ...]) -> str:
    if not cuts:
        return "-"
    if len(cuts) <= 6:  # long cut lists (32-stage pipelines) would swamp the table
        return ",".join(map(str, cuts))
    return f"{cuts[0]},{cuts[1]},{cuts[2]},...,{cuts[-1]} ({len(cuts)} cuts)"


def describe(candidate: Candidate) -> str:
    return (f"dp={candidate.dp} pp={candidate.pp} {candidate.schedule} m={candidate.num_microbatches} "
            f"micro_batch={candidate.micro_batch}")
