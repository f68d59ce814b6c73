"""data.backend=ray's plan without a cluster: the row-group reads a rank's read tasks make, cut back into steps by
the consumer from blocks of any size, are the arrow backend's steps; each rank reads only its own row groups."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from raydl.data import ray_source
from raydl.data.dataset import open_dataset
from raydl.data.loader import StepLoader
from raydl.data.order import DataPosition
from raydl.data.pieces import concat
from raydl.data.ray_source import GroupTables, PlannedParquet, RankPlan
from tests.unit.test_data_loader import make_dataset

GB = 64


def streamed_blocks(source: PlannedParquet, seed: int):
    """What the read tasks yield, in order, re-cut at random places (Ray Data merges and splits blocks)."""
    rows = pa.concat_tables(table for task in source.get_read_tasks(1) for table in task())
    cuts = np.sort(np.random.default_rng(seed).choice(rows.num_rows, 20, replace=False))
    for a, b in zip([0, *cuts], [*cuts, rows.num_rows]):
        yield rows.slice(a, b - a)


def ray_steps(path, dp_rank: int, dp_size: int, start: DataPosition, executions: int) -> list[tuple]:
    plan = RankPlan(open_dataset(str(path)), "train", 3, True, GB, dp_rank, dp_size)
    out, position = [], start
    for execution in range(executions):
        source = PlannedParquet(plan, position, tag_epoch=False)
        tables = GroupTables(streamed_blocks(source, execution), source.reads)
        out += [(epoch, concat(tables.step(i, epoch, runs))["id"].to_pylist())
                for i, (epoch, runs) in enumerate(source.step_runs())]
        position = source.end
    return out


def arrow_steps(path, dp_rank: int, dp_size: int, start: DataPosition, n: int) -> list[tuple]:
    loader = StepLoader(open_dataset(str(path)), global_batch=GB, dp_rank=dp_rank, dp_size=dp_size, seed=3,
                        shuffle=True, position=start, prefetch=0)
    return [(batch.position.epoch, batch.tensors["id"].tolist()) for _, batch in zip(range(n), loader)]


def test_ray_plan_gives_the_arrow_steps_across_executions_and_epochs(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_source, "PLAN_STEPS", 7)              # plans cut row groups: some are read twice
    monkeypatch.setattr(ray_source, "READS_PER_EXECUTION", 12)
    path = make_dataset(tmp_path, shards=8, rows=640)             # 80 steps per epoch
    start = DataPosition(0, 61 * GB)
    for dp_size, dp_rank in [(2, 1), (4, 0), (1, 0)]:
        got = ray_steps(path, dp_rank, dp_size, start, executions=4)
        assert got[-1][0] >= 1 and len(got) > 28                      # ran into the next epoch
        expected = arrow_steps(path, dp_rank, dp_size, start, len(got))
        assert got == expected


def test_a_rank_reads_only_its_row_groups(tmp_path):
    path = make_dataset(tmp_path, shards=8, rows=640)
    plan = [RankPlan(open_dataset(str(path)), "train", 3, True, GB, r, 2) for r in range(2)]
    reads = [PlannedParquet(p, DataPosition(), tag_epoch=False).reads for p in plan]
    epoch0 = [{r.group for r in rank_reads if r.epoch == 0} for rank_reads in reads]
    assert not epoch0[0] & epoch0[1] and len(epoch0[0] | epoch0[1]) == 24      # 24 row groups, split between ranks
    loaded = [sum(r.hi - r.lo for r in rank_reads if r.epoch == 0) for rank_reads in reads]
    assert loaded == [2560, 2560]                                 # each rank's reads carry only its half of the rows
