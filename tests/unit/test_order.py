"""The epoch order: deterministic, different per epoch, exactly once for any world size, and a rank's rows
from its own lanes' row groups."""

from __future__ import annotations

import numpy as np

from raydl.data.order import LANES, EpochOrder, RowGroup, runs, steps_per_epoch

GROUPS = tuple(RowGroup(shard=i // 4, index=i % 4, rows=256 if i % 4 else 200) for i in range(40))
STARTS = np.concatenate([[0], np.cumsum([g.rows for g in GROUPS])])


def dataset_rows(order: EpochOrder, group: np.ndarray, row: np.ndarray) -> np.ndarray:
    """(row group, row in its shuffled order) -> the row's number in the dataset (file order)."""
    permutations = {g: order.row_permutation(g) for g in set(group.tolist())}   # one per row group, not per row
    stored = np.array([permutations[g][r] for g, r in zip(group.tolist(), row.tolist())], dtype=np.int64)
    return STARTS[group] + stored


def sequence(order: EpochOrder) -> np.ndarray:
    """Global row numbers (dataset order) in the epoch's sequence."""
    return dataset_rows(order, *order.group_rows(*order.lane_rows(np.arange(order.num_rows))))


def test_same_seed_same_order_next_epoch_different():
    a = sequence(EpochOrder(GROUPS, seed=1, epoch=0, shuffle=True))
    b = sequence(EpochOrder(GROUPS, seed=1, epoch=0, shuffle=True))
    c = sequence(EpochOrder(GROUPS, seed=1, epoch=1, shuffle=True))
    d = sequence(EpochOrder(GROUPS, seed=2, epoch=0, shuffle=True))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, d)
    assert sorted(a) == sorted(c) == list(range(sum(g.rows for g in GROUPS)))


def test_unshuffled_order_is_file_order():
    seq = sequence(EpochOrder(GROUPS, seed=0, epoch=3, shuffle=False))
    assert np.array_equal(seq, np.arange(len(seq)))


def test_lanes_end_within_a_row_group_of_each_other():
    order = EpochOrder(GROUPS, seed=4, epoch=0, shuffle=True)
    assert len(order.lanes) == LANES and sorted(g for lane in order.lanes for g in lane) == list(range(len(GROUPS)))
    assert order.lane_lengths.max() - order.lane_lengths.min() <= max(g.rows for g in GROUPS)


def consumed(order: EpochOrder, global_batch: int, start: int, stop: int, dp_size: int) -> list[int]:
    out = []
    for offset in range(start, stop, global_batch):
        for r in range(dp_size):
            _, group, row = order.rank_rows(offset, steps=1, global_batch=global_batch, dp_rank=r, dp_size=dp_size)
            out.extend(dataset_rows(order, group, row).tolist())
    return out


def test_exactly_once_across_a_resize():
    order = EpochOrder(GROUPS, seed=5, epoch=0, shuffle=True)
    gb, steps = 48, steps_per_epoch(order.num_rows, 48)
    half = (steps // 2) * gb
    ids = consumed(order, gb, 0, half, dp_size=2) + consumed(order, gb, half, steps * gb, dp_size=3)
    assert len(ids) == len(set(ids)) == steps * gb
    assert set(ids) == set(sequence(order)[:steps * gb].tolist())


def test_a_steps_rows_do_not_depend_on_the_world_size():
    order = EpochOrder(GROUPS, seed=6, epoch=1, shuffle=True)
    for offset in (0, 64 * 70, order.num_rows - 2 * 64):      # the first, a middle, and a step past the lanes' end
        steps = [consumed(order, 64, offset, offset + 64, dp) for dp in (1, 2, 4)]
        assert steps[0] == steps[1] == steps[2]                # the same rows, in the same order
        assert set(steps[0]) == set(sequence(order)[offset:offset + 64].tolist())


def test_each_rank_takes_whole_lanes_when_dp_divides_the_lanes():
    order = EpochOrder(GROUPS, seed=7, epoch=0, shuffle=True)
    gb = 256
    full = order.lane_lengths.min() * LANES // gb        # steps before the shortest lane ends
    for dp in (2, 4):
        for r in range(dp):
            _, group, _ = order.rank_rows(0, steps=int(full), global_batch=gb, dp_rank=r, dp_size=dp)
            lanes = {k for k, lane in enumerate(order.lanes) if set(lane) & set(group.tolist())}
            assert lanes == set(range(r * LANES // dp, (r + 1) * LANES // dp)), (dp, r)


def test_runs_are_the_rows_in_order():
    group, row = np.array([3, 3, 3, 5, 5, 3, 3]), np.array([7, 8, 9, 0, 1, 10, 12])
    got = [(r.group, r.start, r.length) for r in runs(group, row)]
    assert got == [(3, 7, 3), (5, 0, 2), (3, 10, 1), (3, 12, 1)]
