"""The epoch order: a pure function of (dataset layout, seed, epoch). No I/O here.

Exactly once per epoch, across restarts and resizes, comes from one idea: every epoch is
a single global sequence of rows, and a training step consumes the next `global_batch`
rows of it, data-parallel rank r taking the r-th contiguous slice. The only state is the
position in that sequence (`DataPosition`), which does not depend on the world size, so a
run that restarts with 3 workers instead of 2 continues at the same position: nothing seen
twice, nothing skipped. A final partial global batch is dropped (drop_last), the same for
every world size.

Shuffling works at two levels so a row never needs random access: the row groups
(`ROW_GROUP_ROWS` rows) are permuted, grouped into windows of `WINDOW_ROW_GROUPS`, and the
rows of each window are permuted together. Same seed and epoch -> same order; the next
epoch -> a different one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

WINDOW_ROW_GROUPS = 8


@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    offset: int = 0        # rows of this epoch's sequence already consumed (all ranks together)

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}


@dataclass(frozen=True)
class RowGroup:
    shard: int
    index: int
    rows: int


@dataclass(frozen=True)
class EpochOrder:
    row_groups: tuple[RowGroup, ...]
    seed: int
    epoch: int
    shuffle: bool

    @cached_property
    def windows(self) -> list[list[int]]:
        """Row-group indices of each window, in sequence order."""
        order = np.arange(len(self.row_groups))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
        return [order[i:i + WINDOW_ROW_GROUPS].tolist() for i in range(0, len(order), WINDOW_ROW_GROUPS)]

    @cached_property
    def window_starts(self) -> np.ndarray:
        sizes = [sum(self.row_groups[g].rows for g in w) for w in self.windows]
        return np.concatenate([[0], np.cumsum(sizes)])

    @property
    def num_rows(self) -> int:
        return int(self.window_starts[-1])

    def row_permutation(self, window: int) -> np.ndarray:
        """Order of the rows of `window` (rows numbered as its row groups are concatenated)."""
        n = int(self.window_starts[window + 1] - self.window_starts[window])
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.epoch, window]).permutation(n)

    def locate(self, position: int) -> tuple[int, int]:
        """Global position in the epoch -> (window, offset within the window)."""
        window = int(np.searchsorted(self.window_starts, position, side="right") - 1)
        return window, position - int(self.window_starts[window])


def steps_per_epoch(num_rows: int, global_batch: int) -> int:
    return num_rows // global_batch


def rank_slice(position: int, *, global_batch: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """[start, end) of the rows this data-parallel rank takes for the step starting at `position`."""
    per_rank = global_batch // dp_size
    start = position + dp_rank * per_rank
    return start, start + per_rank


def rank_rows_in_window(order: EpochOrder, window: int, *, offset: int, global_batch: int, dp_rank: int,
                        dp_size: int) -> np.ndarray:
    """Which rows of `window` (numbered in its shuffled order) this rank takes, in order, for the
    full global steps from `offset` to the end of the epoch: its `rank_slice` of each step."""
    last = offset + steps_per_epoch(order.num_rows - offset, global_batch) * global_batch
    lo, hi = max(int(order.window_starts[window]), offset), min(int(order.window_starts[window + 1]), last)
    positions = np.arange(lo, hi)
    mine = (positions - offset) % global_batch // (global_batch // dp_size) == dp_rank
    return positions[mine] - int(order.window_starts[window])
