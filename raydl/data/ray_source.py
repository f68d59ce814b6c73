"""`data.backend=ray`: each rank streams its rows through Ray Data, several epochs per execution.

The rows, their order and the data positions are those of the arrow backend (raydl.data.order):
one global sequence per epoch, rank r taking the r-th slice of every global batch. What Ray
Data adds is where the work runs: read tasks on the cluster's CPUs decode the parquet row
groups this rank takes rows of and shuffle them, `map_batches` preprocesses them
(image augmentation, raydl.data.preprocess) fused into the same tasks, and the streaming
executor keeps a bounded number of blocks in the object store ahead of the consumer, so
reading overlaps compute and a dataset larger than the object store streams through it.

Why a Datasource of our own rather than `ray.data.read_parquet` + `streaming_split` (what Ray
Train's `datasets=` does): `streaming_split` hands blocks to whichever rank asks first, and its
iterator cannot be resumed mid-epoch (no state or skip; open request ray-project/ray#37633).
After a failure or a resize Train restarts the split at the beginning of the epoch, and which
rank saw which row is not reproducible, so a checkpoint cannot say where to continue. And
`read_parquet` reads whole files in file order: it cannot pick row groups, nor read them in a
shuffled order. `PlannedParquet` is a `ray.data.Datasource` whose read tasks read the row
groups that this rank still takes rows of from its position, in the order it first needs them,
`GROUPS_PER_TASK` at a time, so a resumed or resized run streams exactly the rest of the epoch.
Each read sends only the range of the shuffled group that the rank takes; the consumer
(`GroupTables`) cuts the stream back into those ranges and builds each step from them with the
same runs (raydl.data.order) the arrow backend gathers.

An execution covers steps until it has `READS_PER_EXECUTION` row groups, across epochs,
because starting one costs about 0.3 s before the first block (raydl bench ingest), paid once
per execution rather than once per epoch of a small dataset; the last one ends at the loader's last step
(`steps`), and each runs to its end rather than being closed: closing cancels read tasks (`_run_out`).
The read tasks tag rows with their epoch only when the preprocessing needs it (image augmentation is
drawn per epoch).

Cost: a rank decodes only the row groups of its lanes (raydl.data.order), 1/dp of the data
when dp divides 8 and 8 divides the global batch, plus a row group per lane each time the
planning (`PLAN_STEPS` steps at a time) cuts one in two.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

import numpy as np
import pyarrow as pa
import ray
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from raydl.data.dataset import DatasetInfo
from raydl.data.order import DataPosition, EpochOrder, Run, steps_per_epoch
from raydl.data.preprocess import make_preprocess
from raydl.data.pieces import Decoded, Piece
from raydl.data.prefetchers import stop_prefetchers
from raydl.data.shards import SplitReader
from raydl.errors import DataError

READS_PER_EXECUTION = 2048  # row groups; an execution starts in ~0.3 s, so it should cover many
GROUPS_PER_TASK = 32        # 8192 rows at dp=1, as before; tasks of 2048 rows had been 1.6x slower (bench ingest)
PLAN_STEPS = 1024           # steps planned at once: the plan is vectorised over them
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

    @cached_property
    def _orders(self) -> dict[int, EpochOrder]:
        return {}

    def order(self, epoch: int) -> EpochOrder:
        if epoch not in self._orders:
            self._orders.clear()          # one epoch at a time: the consumer and the planner move forward
            self._orders[epoch] = SplitReader(self.info, self.split, seed=self.seed, shuffle=self.shuffle).order(epoch)
        return self._orders[epoch]

    def __getstate__(self) -> dict:
        """Pickled into every read task: without the orders, which the tasks do not use (a large dataset's are MBs)."""
        return {k: v for k, v in self.__dict__.items() if k != "_orders"}



@dataclass(frozen=True)
class Read:
    """Rows [lo, hi) of a row group in `epoch`'s shuffled order, last used by the execution's step `last_step`."""
    epoch: int
    group: int
    lo: int
    hi: int
    last_step: int


def stream(info: DatasetInfo, split: str, *, start: DataPosition, seed: int, shuffle: bool, global_batch: int,
           dp_rank: int, dp_size: int, augment: bool, prefetch: int, read_cpus: float,
           steps: int | None = None) -> Iterator[tuple[int, list[Piece]]]:
    """(epoch, this rank's rows) for each step from `start` on: `steps` of them (None: until closed)."""
    if not ray.is_initialized():
        raise DataError("data.backend=ray needs a Ray cluster, and this worker is not in one (torchrun?). "
                        "Fix: run with `raydl train`, or set data.backend=arrow.")
    _configure_ray_data()
    plan = RankPlan(info, split, seed, shuffle, global_batch, dp_rank, dp_size)
    preprocess = make_preprocess(info.meta, augment=augment, seed=seed)
    position = start
    while steps is None or steps > 0:
        source = PlannedParquet(plan, position, tag_epoch=preprocess is not None, max_steps=steps)
        tasks = -(-len(source.reads) // GROUPS_PER_TASK)
        ds = ray.data.read_datasource(source, num_cpus=read_cpus, override_num_blocks=tasks)
        if preprocess is not None:
            ds = ds.map_batches(_by_epoch, fn_args=(preprocess,), batch_format="pyarrow", batch_size=None,
                                zero_copy_batch=True, num_cpus=read_cpus)
        threads = set(threading.enumerate())
        blocks = _unwrapped(ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=max(prefetch, 1)))
        tables = GroupTables(blocks, source.reads)
        try:
            for index, (epoch, runs) in enumerate(source.step_runs()):
                pieces = tables.step(index, epoch, runs)
                if index == source.step_count - 1:
                    _run_out(blocks)
                yield epoch, pieces
        finally:
            blocks.close()
            _join_fetch_threads(threads)
        position = source.end
        steps = None if steps is None else steps - source.step_count


def _run_out(blocks: Iterator[pa.Table]) -> None:
    """Let an execution whose steps are all read end by itself. Closing it instead has Ray Data cancel the read
    tasks still finishing, and a cancel racing a task's completion aborts this process in Ray 2.60's core
    worker ("Check failed: it != submissible_tasks_.end() Tried to complete task that was not pending",
    the race of ray-project/ray#54527); every block has been consumed, so this only waits for the end."""
    for _ in blocks:
        pass


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


@atexit.register
def _leave_ray_get_before_ray_shuts_down() -> None:
    """At interpreter exit, stop the loaders' prefetch threads and wait for the fetch threads that
    outlived their stream's close (a block restored from spill on a loaded machine) before Ray's own
    exit hook disconnects this process: registered after `import ray`, so it runs first."""
    stop_prefetchers()
    _join_fetch_threads(set(), timeout_s=30.0)


def _by_epoch(table: pa.Table, preprocess) -> pa.Table:
    """map_batches: preprocess each epoch's rows of a block (Ray Data may merge a task's reads,
    across an epoch boundary) for that epoch."""
    epochs = table.column(EPOCH_COLUMN).to_numpy()
    table = table.drop_columns([EPOCH_COLUMN])
    bounds = [0, *(np.flatnonzero(np.diff(epochs)) + 1), len(epochs)]
    return pa.concat_tables([preprocess(table.slice(a, b - a), int(epochs[a])) for a, b in zip(bounds, bounds[1:])])


def _unwrapped(blocks: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """Blocks, with a read task's DataError (a bad shard) raised as itself rather than inside
    Ray's RayTaskError and its trace. Other errors (a lost node) stay failures that Ray retries."""
    try:
        yield from blocks
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DataError):
            raise e.cause.with_traceback(None) from None
        raise


class GroupTables:
    """The consumer's side of the reads: cuts the stream of blocks (Ray Data may merge or split what a read task
    yields) back into the reads' row ranges, and builds each step from them, dropping a range after its last step."""

    def __init__(self, blocks: Iterator[pa.Table], reads: list[Read]):
        self.blocks, self.reads = blocks, iter(reads)
        self.pending: pa.Table | None = None          # rows streamed but not yet cut into a read
        self.ranges: dict[tuple[int, int], tuple[Read, Decoded]] = {}

    def step(self, index: int, epoch: int, runs: list[Run]) -> list[Piece]:
        pieces = []
        for run in runs:
            read, decoded = self._range(epoch, run.group)
            pieces.append(Piece(decoded, slice(run.start - read.lo, run.start - read.lo + run.length)))
        self.ranges = {key: value for key, value in self.ranges.items() if value[0].last_step > index}
        return pieces

    def _range(self, epoch: int, group: int) -> tuple[Read, Decoded]:
        while (epoch, group) not in self.ranges:     # reads arrive in the order of their first use
            read = next(self.reads)
            self.ranges[(read.epoch, read.group)] = (read, Decoded(self._cut(read.hi - read.lo)))
        return self.ranges[(epoch, group)]

    def _cut(self, rows: int) -> pa.Table:
        while self.pending is None or self.pending.num_rows < rows:
            block = next(self.blocks)
            self.pending = block if self.pending is None else pa.concat_tables([self.pending, block])
        table, self.pending = self.pending.slice(0, rows), self.pending.slice(rows)
        return table


def _read_groups(plan: RankPlan, reads: list[Read], tag_epoch: bool) -> Iterator[pa.Table]:
    """Runs in a Ray Data read task: for each read, decode and shuffle its row group, keep the range this rank
    takes; one block per read."""
    reader = SplitReader(plan.info, plan.split, seed=plan.seed, shuffle=plan.shuffle, decode_threads=False)
    for read in reads:
        table = reader.piece(reader.order(read.epoch), read.group, read.lo, read.hi - read.lo).arrow()
        if tag_epoch:
            table = table.append_column(EPOCH_COLUMN, pa.repeat(pa.scalar(read.epoch, pa.int32()), table.num_rows))
        yield table


class PlannedParquet(Datasource):
    """The row groups this rank takes rows of, in the order it first needs them, from `start` on, for the
    steps (`PLAN_STEPS` at a time, across epochs) until there are `READS_PER_EXECUTION` of them or `max_steps`;
    `GROUPS_PER_TASK` per read task. `spans`: (start, steps) of this execution's runs of steps; `end`: after them."""

    def __init__(self, plan: RankPlan, start: DataPosition, *, tag_epoch: bool, max_steps: int | None = None):
        super().__init__()
        self.plan, self.tag_epoch = plan, tag_epoch
        self.reads: list[Read] = []
        self.spans: list[tuple[DataPosition, int]] = []
        self.step_count = 0
        epoch, offset = start.epoch, start.offset
        wanted = math.inf if max_steps is None else max_steps
        while self.step_count < wanted and (not self.step_count or len(self.reads) < READS_PER_EXECUTION):
            order = plan.order(epoch)
            left = steps_per_epoch(order.num_rows - offset, plan.global_batch)
            count = min(left, PLAN_STEPS, wanted - self.step_count)
            self._plan(order, offset, count)
            offset += count * plan.global_batch
            if count == left:
                epoch, offset = epoch + 1, 0
        self.end = DataPosition(epoch, offset)

    def _plan(self, order: EpochOrder, offset: int, count: int) -> None:
        """Reads and span of `count` steps from `offset` of `order`'s epoch."""
        if not count:
            return
        step, group, row = order.rank_rows(offset, steps=count, global_batch=self.plan.global_batch,
                                           dp_rank=self.plan.dp_rank, dp_size=self.plan.dp_size)
        groups, first, which = np.unique(group, return_index=True, return_inverse=True)
        lo, hi, last = np.full(len(groups), row.max()), np.zeros(len(groups), row.dtype), np.zeros(len(groups), int)
        np.minimum.at(lo, which, row)
        np.maximum.at(hi, which, row + 1)
        np.maximum.at(last, which, step + self.step_count)
        self.reads += [Read(order.epoch, int(groups[i]), int(lo[i]), int(hi[i]), int(last[i]))
                       for i in np.argsort(first).tolist()]
        self.spans.append((DataPosition(order.epoch, offset), count))
        self.step_count += count

    def step_runs(self) -> Iterator[tuple[int, list[Run]]]:
        """(epoch, this rank's runs) of each step of the execution, in order: what the arrow backend gathers."""
        plan = self.plan
        for start, count in self.spans:
            for runs in plan.order(start.epoch).steps_runs(start.offset, steps=count, global_batch=plan.global_batch,
                                                           dp_rank=plan.dp_rank, dp_size=plan.dp_size):
                yield start.epoch, runs

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list:
        tasks = [self.reads[i:i + GROUPS_PER_TASK] for i in range(0, len(self.reads), GROUPS_PER_TASK)]
        return [ReadTask(functools.partial(_read_groups, self.plan, reads, self.tag_epoch),
                         BlockMetadata(num_rows=sum(r.hi - r.lo for r in reads), size_bytes=None, exec_stats=None,
                                       input_files=None))
                for reads in tasks]
