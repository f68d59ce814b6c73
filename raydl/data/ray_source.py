"""`data.backend=ray`: each rank streams its rows through Ray Data, several epochs per execution.

The rows, their order and the data positions are those of the arrow backend (raydl.data.order):
one global sequence per epoch, rank r taking the r-th slice of every global batch. What Ray
Data adds is where the work runs: read tasks on the cluster's CPUs decode the parquet row
groups, shuffle each window and keep only this rank's rows, `map_batches` preprocesses them
(image augmentation, raydl.data.preprocess) fused into the same tasks, and the streaming
executor keeps a bounded number of blocks in the object store ahead of the consumer, so
reading overlaps compute and a dataset larger than the object store streams through it.

Why a Datasource of our own rather than `ray.data.read_parquet` + `streaming_split` (what Ray
Train's `datasets=` does): `streaming_split` hands blocks to whichever rank asks first, and its
iterator cannot be resumed mid-epoch (no state or skip; open request ray-project/ray#37633).
After a failure or a resize Train restarts the split at the beginning of the epoch, and which
rank saw which row is not reproducible, so a checkpoint cannot say where to continue. And
`read_parquet` reads whole files in file order: it cannot pick row groups, nor read them in a
shuffled order. `PlannedParquet` is a `ray.data.Datasource` whose read tasks read the windows of
the plan that this rank still needs from its position, `WINDOWS_PER_TASK` at a time, so a resumed or resized run streams
exactly the rest of the epoch.

An execution covers whole epochs until it has `READS_PER_EXECUTION` windows, because
starting one costs about 0.3 s before the first block (raydl bench ingest), paid once per
execution rather than once per epoch of a small dataset. The read tasks tag rows with their
epoch only when the preprocessing needs it (image augmentation is drawn per epoch).

Cost: like the arrow backend, every rank decodes every window of the epoch and keeps its
1/dp share, so decoding grows with the data-parallel degree (the object store and the
training process see only the rank's share).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import ray
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from raydl.data.dataset import DatasetInfo
from raydl.data.order import DataPosition, rank_rows_in_window, steps_per_epoch
from raydl.data.preprocess import make_preprocess
from raydl.data.shards import SplitReader, take_rows
from raydl.errors import DataError

READS_PER_EXECUTION = 256   # windows; an execution starts in ~0.3 s, so it should cover many
WINDOWS_PER_TASK = 4        # one block each; per-task overhead made 1 window per task 1.6x slower (bench ingest)
EPOCH_COLUMN = "_raydl_epoch"


@dataclass(frozen=True)
class RankPlan:
    """What one rank reads: the split, its shuffle, and its share of every global batch."""
    info: DatasetInfo
    split: str
    seed: int
    shuffle: bool
    global_batch: int
    dp_rank: int
    dp_size: int

    def order(self, epoch: int):
        return SplitReader(self.info, self.split, seed=self.seed, shuffle=self.shuffle).order(epoch)

    def rows(self, order, window: int, offset: int):
        return rank_rows_in_window(order, window, offset=offset, global_batch=self.global_batch,
                                   dp_rank=self.dp_rank, dp_size=self.dp_size)


def stream(info: DatasetInfo, split: str, *, start: DataPosition, seed: int, shuffle: bool, global_batch: int,
           dp_rank: int, dp_size: int, augment: bool, prefetch: int, read_cpus: float) -> Iterator[tuple[int, pa.Table]]:
    """(epoch, this rank's rows) for each step from `start` on."""
    if not ray.is_initialized():
        raise DataError("data.backend=ray needs a Ray cluster, and this worker is not in one (torchrun?). "
                        "Fix: run with `raydl train`, or set data.backend=arrow.")
    _configure_ray_data()
    plan = RankPlan(info, split, seed, shuffle, global_batch, dp_rank, dp_size)
    preprocess = make_preprocess(info.meta, augment=augment, seed=seed)
    position = start
    while True:
        source = PlannedParquet(plan, position, tag_epoch=preprocess is not None)
        tasks = -(-len(source.reads) // WINDOWS_PER_TASK)
        ds = ray.data.read_datasource(source, num_cpus=read_cpus, override_num_blocks=tasks)
        if preprocess is not None:
            ds = ds.map_batches(_by_epoch, fn_args=(preprocess,), batch_format="pyarrow", batch_size=None,
                                zero_copy_batch=True, num_cpus=read_cpus)
        threads = set(threading.enumerate())
        blocks = _unwrapped(ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=max(prefetch, 1)))
        steps = _rebatch(blocks, global_batch // dp_size)
        try:
            for epoch, count in source.steps:
                for _ in range(count):
                    yield epoch, next(steps)
        finally:
            blocks.close()
            _join_fetch_threads(threads)
        position = DataPosition(source.steps[-1][0] + 1, 0)


def _configure_ray_data() -> None:
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True     # blocks must arrive in plan order
    context.enable_progress_bars = False
    # One operator, nothing to reserve resources for: with the reservation on, a lone read op on a
    # 2-CPU node ran one task at a time (raydl bench ingest: 1.1 s vs 0.57 s per epoch).
    context.op_resource_reservation_enabled = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)   # not two INFO lines per execution and rank


def _join_fetch_threads(existing: set[threading.Thread], timeout_s: float = 5.0) -> None:
    """Wait for the fetch threads of an `iter_batches` closed early. Closing does not interrupt
    a thread inside `ray.get`, and one still there at interpreter exit aborts the process (the
    raylet client's 'Broken pipe' check)."""
    deadline = time.monotonic() + timeout_s
    for thread in set(threading.enumerate()) - existing:
        if thread.name == "iter_threaded":
            thread.join(max(0.0, deadline - time.monotonic()))


def _by_epoch(table: pa.Table, preprocess) -> pa.Table:
    """map_batches: preprocess each epoch's rows of a block (Ray Data may merge a task's windows,
    across an epoch boundary) for that epoch."""
    epochs = table.column(EPOCH_COLUMN).to_numpy()
    table = table.drop_columns([EPOCH_COLUMN])
    bounds = [0, *(np.flatnonzero(np.diff(epochs)) + 1), len(epochs)]
    return pa.concat_tables([preprocess(table.slice(a, b - a), int(epochs[a])) for a, b in zip(bounds, bounds[1:])])


def _rebatch(blocks: Iterator[pa.Table], rows: int) -> Iterator[pa.Table]:
    """Tables of `rows` rows cut from whole blocks: zero-copy slices except where a step spans two
    blocks. (Ray Data's own batcher rebuilt every batch, which cost the consumer a copy per step.)"""
    pending = None
    for block in blocks:
        pending = block if pending is None else pa.concat_tables([pending, block])
        while pending.num_rows >= rows:
            yield pending.slice(0, rows)
            pending = pending.slice(rows)


def _unwrapped(blocks: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """Blocks, with a read task's DataError (a bad shard) raised as itself rather than inside
    Ray's RayTaskError and its trace. Other errors (a lost node) stay failures that Ray retries."""
    try:
        yield from blocks
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DataError):
            raise e.cause.with_traceback(None) from None
        raise


def _read_windows(plan: RankPlan, reads: list[tuple[int, int, int, int]], tag_epoch: bool) -> Iterator[pa.Table]:
    """Runs in a Ray Data read task: for each (epoch, offset, window, rows), decode the window's
    row groups, shuffle, keep this rank's rows; one block per window."""
    reader = SplitReader(plan.info, plan.split, seed=plan.seed, shuffle=plan.shuffle)
    for epoch, offset, window, _ in reads:
        order = reader.order(epoch)
        table = take_rows(reader.window_rows(order, window),
                          order.row_permutation(window)[plan.rows(order, window, offset)])
        if tag_epoch:
            table = table.append_column(EPOCH_COLUMN, pa.repeat(pa.scalar(epoch, pa.int32()), table.num_rows))
        yield table


class PlannedParquet(Datasource):
    """The windows holding rows of this rank, in plan order, from `start` on, for whole epochs
    until there are `READS_PER_EXECUTION` of them; `WINDOWS_PER_TASK` per read task.
    `steps`: [(epoch, steps of this rank in it)]."""

    def __init__(self, plan: RankPlan, start: DataPosition, *, tag_epoch: bool):
        super().__init__()
        self.plan, self.tag_epoch = plan, tag_epoch
        self.reads: list[tuple[int, int, int, int]] = []      # (epoch, offset, window, rows)
        self.steps: list[tuple[int, int]] = []
        epoch, offset = start.epoch, start.offset
        while not self.steps or len(self.reads) < READS_PER_EXECUTION:
            order = plan.order(epoch)
            self.steps.append((epoch, steps_per_epoch(order.num_rows - offset, plan.global_batch)))
            for window in range(order.locate(min(offset, order.num_rows - 1))[0], len(order.windows)):
                rows = len(plan.rows(order, window, offset))
                if rows:
                    self.reads.append((epoch, offset, window, rows))
            epoch, offset = epoch + 1, 0

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list:
        groups = [self.reads[i:i + WINDOWS_PER_TASK] for i in range(0, len(self.reads), WINDOWS_PER_TASK)]
        return [ReadTask(functools.partial(_read_windows, self.plan, group, self.tag_epoch),
                         BlockMetadata(num_rows=sum(r[3] for r in group), size_bytes=None, exec_stats=None,
                                       input_files=None))
                for group in groups]
