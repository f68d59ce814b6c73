"""The pipeline schedules raydl runs: one row of facts per schedule, read by every other module.

Placement (which global stages a pipeline rank runs) is what torch's schedule classes require:
    single  one stage per rank: rank r runs stage r                      gpipe, 1f1b
    loop    two stages per rank: stage s on rank s % pp                  loopedbfs, interleaved1f1b, interleavedzb
    v       two stages per rank: rank r runs stages r and 2pp-1-r        zbv, dualpipev
Zero-bubble schedules split backward into an input-gradient (B) and a weight-gradient (W) pass.

Bubble: the fill and drain of a pipeline idle p-1 "slots"; a slot is 1/k of one micro-batch's work
on a rank, so the idle share of a step with p ranks and m micro-batches is (p-1)/(k*m+p-1).
    gpipe, 1f1b                  k=1   GPipe, arXiv 1811.06965; 1F1B only saves memory
    loopedbfs, interleaved1f1b   k=2   Megatron-LM interleaved 1F1B, v=2, arXiv 2104.04473
    interleavedzb (ZB-H1)        k=3   Zero Bubble PP, arXiv 2401.10241, T_F = T_B = T_W
    zbv, dualpipev               k=4   see below
ZB-V (and DualPipeV, its cut-in-half DualPipe) fills the pipeline fully in the paper's ideal, but
`raydl bench pipeline` measured 0.08-0.11 at p=2, m=8 (0.10 at m=4; PIPELINE_NOTES §2b 0.08-0.12),
about k=2 on this CPU, where every interleaved/zero-bubble schedule landed within noise of the others.
k=4 keeps the papers' order (ZB-V ahead of ZB-H1) while halving the papers' optimism (k=6).
"""

from __future__ import annotations

from dataclasses import dataclass

from raydl.errors import LayoutError

__all__ = ["Schedule", "SCHEDULES", "NAMES", "PREFERENCE", "get", "stage_indices", "stage_ranks",
           "bubble_fraction", "check_microbatches", "require_positive"]


@dataclass(frozen=True)
class Schedule:
    name: str
    torch_class_name: str      # in torch.distributed.pipelining
    placement: str             # "single" | "loop" | "v" (module docstring)
    zero_bubble: bool
    bubble_slots_per_microbatch: int

    @property
    def stages_per_rank(self) -> int:
        return 1 if self.placement == "single" else 2

    @property
    def bubble_formula(self) -> str:
        k = self.bubble_slots_per_microbatch
        return f"(p-1)/({k if k > 1 else ''}m+p-1)"

    def torch_class(self) -> type:
        from torch.distributed import pipelining   # lazily: this table is read where torch.distributed is not

        return getattr(pipelining, self.torch_class_name)


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "ScheduleGPipe", "single", zero_bubble=False, bubble_slots_per_microbatch=1),
    Schedule("1f1b", "Schedule1F1B", "single", zero_bubble=False, bubble_slots_per_microbatch=1),
    Schedule("loopedbfs", "ScheduleLoopedBFS", "loop", zero_bubble=False, bubble_slots_per_microbatch=2),
    Schedule("interleaved1f1b", "ScheduleInterleaved1F1B", "loop", zero_bubble=False, bubble_slots_per_microbatch=2),
    Schedule("interleavedzb", "ScheduleInterleavedZeroBubble", "loop", zero_bubble=True, bubble_slots_per_microbatch=3),
    Schedule("zbv", "ScheduleZBVZeroBubble", "v", zero_bubble=True, bubble_slots_per_microbatch=4),
    Schedule("dualpipev", "ScheduleDualPipeV", "v", zero_bubble=True, bubble_slots_per_microbatch=4),
)}
NAMES: tuple[str, ...] = tuple(SCHEDULES)
# The planner's tie-break for equal predicted step times: 1f1b first (the time of gpipe with less
# activation memory), then the table's order.
PREFERENCE: tuple[str, ...] = ("1f1b", *(name for name in NAMES if name != "1f1b"))


def get(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise LayoutError(f"unknown pipeline schedule {name!r}; valid schedules: {', '.join(NAMES)}")
    return SCHEDULES[name]


def stage_indices(name: str, pp: int, pp_rank: int) -> tuple[int, ...]:
    """The global stages pipeline rank `pp_rank` runs, in execution order."""
    placement = get(name).placement
    if placement == "single":
        return (pp_rank,)
    if placement == "v":
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return (pp_rank, pp_rank + pp)


def stage_ranks(name: str, pp: int) -> tuple[int, ...]:
    """The pipeline rank of each global stage."""
    owner = {stage: rank for rank in range(pp) for stage in stage_indices(name, pp, rank)}
    return tuple(owner[stage] for stage in range(len(owner)))


def bubble_fraction(name: str, pp: int, num_microbatches: int) -> float:
    """Textbook idle share of the step (module docstring); pp == 1 gives 0."""
    schedule = get(name)
    require_positive(pp=pp, num_microbatches=num_microbatches)
    slots = schedule.bubble_slots_per_microbatch * num_microbatches
    if num_microbatches < pp and schedule.stages_per_rank > 1:
        # Fewer micro-batches than ranks: a rank's two stages cannot overlap anything, so the
        # multi-stage schedules idle like GPipe (measured 0.52 for loopedbfs/interleaved1f1b at p=2, m=1).
        slots = num_microbatches
    return (pp - 1) / (slots + pp - 1)


def check_microbatches(name: str, pp: int, m: int) -> None:
    """The checks torch 2.13's schedule constructors make, raised before any process starts."""
    if name == "1f1b" and m < pp:
        raise LayoutError(
            f"schedule '1f1b' needs num_microbatches >= pp (torch Schedule1F1B); got num_microbatches={m} "
            f"< pp={pp}; use num_microbatches >= {pp} or schedule 'gpipe'"
        )
    rounds = max(1, m // pp)
    if name in ("interleaved1f1b", "interleavedzb") and m % rounds:
        raise LayoutError(
            f"schedule {name!r} needs num_microbatches divisible by max(1, num_microbatches // pp) = "
            f"{rounds}; got num_microbatches={m}, pp={pp}; use a multiple of pp such as {rounds * pp}"
        )
    if name == "dualpipev" and m < 2 * pp:
        raise LayoutError(
            f"schedule 'dualpipev' needs num_microbatches >= number of stages = 2*pp = {2 * pp}; got "
            f"num_microbatches={m}; use num_microbatches >= {2 * pp}"
        )


def require_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"{name}={value!r} must be a positive integer")
