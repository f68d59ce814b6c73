"""The epoch order: deterministic, different per epoch, exactly once for any world size."""

from __future__ import annotations

import numpy as np

from raydl.data.order import EpochOrder, RowGroup, rank_rows_in_window, rank_slice, steps_per_epoch

GROUPS = tuple(RowGroup(shard=i // 4, index=i % 4, rows=256 if i % 4 else 200) for i in range(40))


def sequence(order: EpochOrder) -> np.ndarray:
    """Global row numbers (dataset order) in the epoch's sequence."""
    starts = np.concatenate([[0], np.cumsum([g.rows for g in order.row_groups])])
    out = []
    for w, groups in enumerate(order.windows):
        rows = np.concatenate([np.arange(starts[g], starts[g] + order.row_groups[g].rows) for g in groups])
        out.append(rows[order.row_permutation(w)])
    return np.concatenate(out)


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


def consumed(order: EpochOrder, global_batch: int, start: int, stop: int, dp_size: int) -> list[int]:
    seq = sequence(order)
    out = []
    for position in range(start, stop, global_batch):
        for r in range(dp_size):
            lo, hi = rank_slice(position, global_batch=global_batch, dp_rank=r, dp_size=dp_size)
            out.extend(seq[lo:hi].tolist())
    return out


def test_exactly_once_across_a_resize():
    order = EpochOrder(GROUPS, seed=5, epoch=0, shuffle=True)
    gb, steps = 48, steps_per_epoch(order.num_rows, 48)
    half = (steps // 2) * gb
    ids = consumed(order, gb, 0, half, dp_size=2) + consumed(order, gb, half, steps * gb, dp_size=3)
    assert len(ids) == len(set(ids)) == steps * gb
    assert set(ids) == set(sequence(order)[:steps * gb].tolist())


def test_locate_round_trips():
    order = EpochOrder(GROUPS, seed=0, epoch=0, shuffle=True)
    for position in (0, 1, 255, 2047, order.num_rows - 1):
        window, offset = order.locate(position)
        assert order.window_starts[window] + offset == position
        assert 0 <= offset < order.window_starts[window + 1] - order.window_starts[window]


def test_rank_rows_in_window_are_the_rank_slices_of_each_step():
    """What a Ray Data read task keeps of a window, concatenated over windows, is the rank's slice of
    every full step from the offset on: the same rows the arrow reader serves."""
    order = EpochOrder(GROUPS, seed=3, epoch=2, shuffle=True)
    for offset, global_batch, dp_size in [(0, 96, 3), (5 * 64, 64, 2), (17 * 48, 48, 4), (0, 50, 4)]:
        for dp_rank in range(dp_size):
            kept = [order.window_starts[w] + rank_rows_in_window(order, w, offset=offset, global_batch=global_batch,
                                                                 dp_rank=dp_rank, dp_size=dp_size)
                    for w in range(len(order.windows))]
            expected = [np.arange(*rank_slice(offset + s * global_batch, global_batch=global_batch,
                                              dp_rank=dp_rank, dp_size=dp_size))
                        for s in range(steps_per_epoch(order.num_rows - offset, global_batch))]
            assert np.array_equal(np.concatenate(kept), np.concatenate(expected)), (offset, global_batch, dp_rank)
