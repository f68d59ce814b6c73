"""The epoch order: a pure function of (dataset layout, seed, epoch). No I/O here.

Exactly once per epoch, across restarts and resizes, comes from one idea: every epoch is
a single global sequence of rows, and a training step consumes the next `global_batch`
rows of it. The only state is the position in that sequence (`DataPosition`), which does
not depend on the world size, so a run that restarts with 3 workers instead of 2 continues
at the same position: nothing seen twice, nothing skipped. A final partial global batch is
dropped (drop_last), the same for every world size.

Shuffling works at two levels so a row never needs random access: the row groups
(`ROW_GROUP_ROWS` rows) are permuted and dealt to `LANES` lanes (largest first, each to the
lane with the fewest rows so far, so lanes end within about a row group of each other; a lane
reads its groups in the permuted order), and each row group's rows are permuted. The
sequence interleaves the lanes round-robin: position j takes the next row of lane j mod
LANES, continuing over the lanes that still have rows once the shortest has ended. A step's
rows therefore mix `LANES` row groups. Same seed and epoch -> same order; the next epoch ->
a different one. Without shuffling there is one lane: file order.

Which rank takes which rows of a step is free (the step's set of rows is fixed): the step's
positions sorted by (lane, position), rank r takes the r-th contiguous 1/dp of them. When dp
divides LANES and LANES divides the global batch, each lane gives a step global_batch/LANES
rows, so rank r takes whole lanes (LANES/dp of them) and decodes only their row groups: 1/dp
of the data. It decodes more where a lane is shared by two ranks: when dp does not divide
LANES (dp=3: up to 1/2 of the data instead of 1/3), when LANES does not divide the global
batch (a lane's rows per step vary by one, so the lane at a rank's edge moves), and at the
end of the epoch, once the shortest lane has ended (within one row group of the end).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

import numpy as np

LANES = 8
PLANNED_STEPS = 64


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
class Run:
    """`length` consecutive rows of a row group, counted in the group's shuffled order."""
    group: int
    start: int
    length: int


@dataclass(frozen=True)
class EpochOrder:
    row_groups: tuple[RowGroup, ...]
    seed: int
    epoch: int
    shuffle: bool

    @cached_property
    def lanes(self) -> list[list[int]]:
        """Row-group indices of each lane, in the order the lane reads them."""
        if not self.shuffle:
            return [list(range(len(self.row_groups)))]
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.row_groups)).tolist()
        lanes: list[list[int]] = [[] for _ in range(max(1, min(LANES, len(order))))]
        rows = np.zeros(len(lanes), dtype=np.int64)
        # Largest first (stable: in shuffled order within a size), each to the lane with the fewest rows: the
        # lanes end close together, and a rank's share stays its own lanes until they do. Ties go to lanes in
        # bit-reversed order (0, 4, 2, 6, ...), so the lanes left longest belong to different ranks: at the end,
        # when only they have rows, each rank still takes its own.
        spread = _bit_reversed(len(lanes))
        for g in sorted(order, key=lambda g: -self.row_groups[g].rows):
            lane = spread[int(np.argmin(rows[spread]))]
            lanes[lane].append(g)
            rows[lane] += self.row_groups[g].rows
        shuffled_rank = {g: i for i, g in enumerate(order)}
        return [sorted(lane, key=shuffled_rank.__getitem__) for lane in lanes]

    @cached_property
    def _lane_arrays(self) -> list[np.ndarray]:
        return [np.asarray(lane, dtype=np.int64) for lane in self.lanes]

    @cached_property
    def lane_starts(self) -> list[np.ndarray]:
        """Per lane, where each of its row groups starts in the lane, and the lane's length last."""
        return [np.concatenate([[0], np.cumsum([self.row_groups[g].rows for g in lane], dtype=np.int64)])
                for lane in self.lanes]

    @cached_property
    def lane_lengths(self) -> np.ndarray:
        return np.array([int(starts[-1]) for starts in self.lane_starts], dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.lane_lengths.sum())

    @cached_property
    def _tail(self) -> tuple[np.ndarray, np.ndarray]:
        """(lane, index in lane) of the positions after the shortest lane has ended, in sequence order."""
        rounds = np.arange(self.lane_lengths.min(), self.lane_lengths.max())
        index, lane = np.nonzero(rounds[:, None] < self.lane_lengths[None, :])     # row-major: round, then lane
        return lane, rounds[index]

    def lane_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions in the epoch -> (lane, index of the row within its lane)."""
        lanes = len(self.lanes)
        full_rounds = lanes * int(self.lane_lengths.min())
        lane, index = positions % lanes, positions // lanes
        tail = positions >= full_rounds
        if tail.any():
            lane[tail], index[tail] = (a[positions[tail] - full_rounds] for a in self._tail)
        return lane, index

    def group_rows(self, lane: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lane, index in lane) -> (row group, row within the group's shuffled order)."""
        group, row = np.empty_like(index), np.empty_like(index)
        for k in np.unique(lane).tolist():
            at = lane == k
            slot = np.searchsorted(self.lane_starts[k], index[at], side="right") - 1
            group[at] = self._lane_arrays[k][slot]
            row[at] = index[at] - self.lane_starts[k][slot]
        return group, row

    def row_permutation(self, group: int) -> np.ndarray:
        """Order of the rows of row group `group` (numbered as stored)."""
        n = self.row_groups[group].rows
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.epoch, group]).permutation(n)

    def sequence_runs(self, start: int, end: int) -> list[Run]:
        """Positions [start, end) of the epoch sequence, in sequence order."""
        return runs(*self.group_rows(*self.lane_rows(np.arange(start, end))))

    def rank_rows(self, offset: int, *, steps: int, global_batch: int, dp_rank: int,
                  dp_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(step, row group, row in the group's shuffled order) of each row this rank takes in the `steps`
        global steps from `offset`, in the order it takes them: each step's positions sorted by (lane,
        position), the rank's contiguous 1/dp of them."""
        positions = np.arange(offset, offset + steps * global_batch)
        lane, index = self.lane_rows(positions)
        step = (positions - offset) // global_batch
        order = np.lexsort((lane, step)).reshape(steps, global_batch)     # stable: position order within a lane
        per_rank = global_batch // dp_size
        mine = order[:, dp_rank * per_rank:(dp_rank + 1) * per_rank].ravel()
        return (step[mine], *self.group_rows(lane[mine], index[mine]))

    def step_runs(self, offset: int, *, global_batch: int, dp_rank: int, dp_size: int) -> list[Run]:
        """This rank's rows of the global step starting at `offset`."""
        return next(self.steps_runs(offset, steps=1, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size))

    def steps_runs(self, offset: int, *, steps: int, global_batch: int, dp_rank: int,
                   dp_size: int) -> Iterator[list[Run]]:
        """`step_runs` of `steps` consecutive steps from `offset`, worked out `PLANNED_STEPS` at a time (per step,
        numpy's call overhead was a tenth of an epoch's CPU time in raydl bench ingest)."""
        per_rank = global_batch // dp_size
        for first in range(0, steps, PLANNED_STEPS):
            count = min(PLANNED_STEPS, steps - first)
            _, group, row = self.rank_rows(offset + first * global_batch, steps=count, global_batch=global_batch,
                                           dp_rank=dp_rank, dp_size=dp_size)
            starts = run_starts(group, row, every=per_rank)
            all_runs = runs_from(starts, group, row)
            bounds = np.searchsorted(starts, np.arange(0, (count + 1) * per_rank, per_rank)).tolist()
            for a, b in itertools.pairwise(bounds):
                yield all_runs[a:b]


def _bit_reversed(n: int) -> np.ndarray:
    bits = max(1, (n - 1).bit_length())
    return np.array(sorted(range(n), key=lambda k: int(format(k, f"0{bits}b")[::-1], 2)))


def runs(group: np.ndarray, row: np.ndarray) -> list[Run]:
    """(row group, row) pairs -> the fewest runs of consecutive rows of one group, in the same order."""
    return runs_from(run_starts(group, row), group, row) if len(group) else []


def run_starts(group: np.ndarray, row: np.ndarray, *, every: int = 0) -> np.ndarray:
    """Where `runs` of the pairs start; with `every`, also at every `every`-th pair (where a step's rows
    begin: a step's runs are then worked out with the others', at once)."""
    start = np.concatenate([[True], (np.diff(group) != 0) | (np.diff(row) != 1)])
    if every:
        start[::every] = True
    return np.flatnonzero(start)


def runs_from(starts: np.ndarray, group: np.ndarray, row: np.ndarray) -> list[Run]:
    lengths = np.diff(np.append(starts, len(group)))
    return list(map(Run, group[starts].tolist(), row[starts].tolist(), lengths.tolist()))


def steps_per_epoch(num_rows: int, global_batch: int) -> int:
    return num_rows // global_batch
