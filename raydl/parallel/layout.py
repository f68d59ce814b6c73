"""What a worker group trains with: data-parallel × pipeline degrees, the batch split, the wrapper, and the one
sentence the console says about it. A value only: `raydl.parallel.mesh.layout_for` decides it from a config and a
world size."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from raydl.parallel.wrapper_policy import WRAPPER_NAMES

__all__ = ["Layout", "describe"]


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp: int
    pp: int
    micro_batch: int          # samples per forward on one rank
    num_microbatches: int     # per optimizer step and replica (gradient accumulation when pp == 1)
    schedule: str = "none"
    stage_cuts: tuple[int, ...] = ()
    dp_wrapper: str = "none"  # the data-parallel wrapper this group trains with (parallel.dp_wrapper, or auto's choice)
    dp_wrapper_reason: str = ""

    @property
    def global_batch(self) -> int:
        return self.dp * self.num_microbatches * self.micro_batch

    def coords(self, rank: int) -> tuple[int, int]:
        """rank -> (dp_rank, pp_rank); pp is the inner axis so a pipeline's stages are neighbours."""
        return rank // self.pp, rank % self.pp

    def to_dict(self) -> dict:
        return asdict(self)


def describe(layout: Layout, *, start_step: int, num_params: int) -> str:
    """The layout as one sentence for the console, e.g. "2 workers: data-parallel × 2 (DDP: ...), micro-batch 32,
    no pipeline, from step 0, 0.80M params"."""
    axes = []
    if layout.dp > 1:
        name = WRAPPER_NAMES.get(layout.dp_wrapper, layout.dp_wrapper)
        axes.append(f"data-parallel × {layout.dp} ({name}: {layout.dp_wrapper_reason})")
    if layout.pp > 1:
        cuts = f", later stages start at blocks {', '.join(map(str, layout.stage_cuts))}" if layout.stage_cuts else ""
        axes.append(f"pipeline × {layout.pp} (schedule {layout.schedule}, {layout.num_microbatches} micro-batches "
                    f"of {layout.micro_batch}{cuts})")
    parts = [" × ".join(axes) or "no data parallelism"]
    if layout.pp == 1:
        m = layout.num_microbatches
        batch = (f"{m} micro-batches of {layout.micro_batch} accumulated per step" if m > 1 else
                 f"micro-batch {layout.micro_batch}")
        parts += [batch, "no pipeline"]
    workers = f"{layout.world_size} worker{'s' if layout.world_size != 1 else ''}"
    return f"{workers}: {', '.join(parts)}, from step {start_step}, {num_params / 1e6:.2f}M params"
