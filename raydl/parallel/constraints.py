"""What torch and the batch arithmetic accept: each check raises LayoutError with the numbers and the fix."""

from __future__ import annotations

import math
from typing import Sequence

from raydl.errors import LayoutError
from raydl.parallel import schedules
from raydl.parallel.schedules import require_positive

__all__ = ["validate_layout", "validate_stage_cuts", "check_mesh", "divisors"]


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
        choices = ", ".join(str(d) for d in divisors(world_size) if d <= num_blocks)
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


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
