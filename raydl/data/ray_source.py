"""`data.backend=ray`: each rank streams its rows of an epoch through one Ray Data execution.

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
shuffled order. `PlannedParquet` is a `ray.data.Datasource` with one read task per window of
the plan that this rank still needs from its position, so a resumed or resized run streams
exactly the rest of the epoch.

Cost: like the arrow backend, every rank decodes every window of the epoch and keeps its
1/dp share, so decoding grows with the data-parallel degree (the object store and the
training process see only the rank's share).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable, Iterator

import pyarrow as pa
import ray
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from raydl.data.dataset import DatasetInfo
from raydl.data.loader import SplitReader
from raydl.data.order import DataPosition, rank_rows_in_window, steps_per_epoch
from raydl.data.preprocess import make_preprocess
from raydl.errors import DataError


LOOKAHEAD_STEPS = 64   # start the next epoch's execution this many steps before the current one ends


def stream(info: DatasetInfo, split: str, *, start: DataPosition, seed: int, shuffle: bool, global_batch: int,
           dp_rank: int, dp_size: int, augment: bool, prefetch: int, read_cpus: float) -> Iterator[tuple[int, pa.Table]]:
    """(epoch, table) for each step from `start` on, one Ray Data execution per epoch.

    An execution takes a few hundred milliseconds to deliver its first block, so the next
    epoch's is started on a thread `LOOKAHEAD_STEPS` steps before the current one runs out."""
    if not ray.is_initialized():
        raise DataError("data.backend=ray needs a Ray cluster, and this worker is not in one (torchrun?). "
                        "Fix: run with `raydl train`, or set data.backend=arrow.")
    def started(epoch: int, offset: int = 0) -> _Started:
        return _Started(functools.partial(epoch_tables, info, split, epoch=epoch, offset=offset, seed=seed,
                                          shuffle=shuffle, global_batch=global_batch, dp_rank=dp_rank,
                                          dp_size=dp_size, augment=augment, prefetch=prefetch, read_cpus=read_cpus))

    epoch, current = start.epoch, started(start.epoch, start.offset)
    while True:
        upcoming = None
        for remaining, table in current:
            if upcoming is None and remaining <= LOOKAHEAD_STEPS:
                upcoming = started(epoch + 1)
            yield epoch, table
        epoch, current = epoch + 1, upcoming or started(epoch + 1)


class _Started:
    """Iterates what `make()` returns, after fetching its first item on a thread started now."""

    _END = object()

    def __init__(self, make: Callable[[], Iterator]):
        self._iterator, self._first, self._error = None, self._END, None
        self._thread = threading.Thread(target=self._start, args=(make,), daemon=True, name="raydl-next-epoch")
        self._thread.start()

    def _start(self, make) -> None:
        try:
            self._iterator = make()
            self._first = next(self._iterator, self._END)
        except BaseException as e:      # re-raised in the consuming thread
            self._error = e

    def __iter__(self) -> Iterator:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._first is not self._END:
            yield self._first
            yield from self._iterator


def epoch_tables(info: DatasetInfo, split: str, *, seed: int, shuffle: bool, epoch: int, offset: int,
                 global_batch: int, dp_rank: int, dp_size: int, augment: bool, prefetch: int,
                 read_cpus: float) -> Iterator[tuple[int, pa.Table]]:
    """(steps left after this one, this rank's rows) for each remaining full step of `epoch`."""
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True     # blocks must arrive in plan order
    context.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)   # not two INFO lines per epoch and rank
    # One operator, nothing to reserve resources for: with the reservation on, a lone read op on a
    # 2-CPU node ran one task at a time (raydl bench ingest: 1.1 s vs 0.57 s per epoch).
    context.op_resource_reservation_enabled = False
    source = PlannedParquet(info, split, seed=seed, shuffle=shuffle, epoch=epoch, offset=offset,
                            global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size)
    # One block per window: Ray Data would otherwise split each task's output for parallelism.
    ds = ray.data.read_datasource(source, num_cpus=read_cpus, override_num_blocks=max(len(source.reads), 1))
    preprocess = make_preprocess(info.meta, augment=augment, seed=seed, epoch=epoch)
    if preprocess is not None:
        ds = ds.map_batches(preprocess, batch_format="pyarrow", batch_size=None, zero_copy_batch=True,
                            num_cpus=read_cpus)
    batches = ds.iter_batches(batch_size=global_batch // dp_size, batch_format="pyarrow",
                              prefetch_batches=max(prefetch, 1))
    steps = source.steps
    try:
        for step, table in enumerate(batches, start=1):
            yield steps - step, table
    except DataError:
        raise
    except Exception as e:     # a read task's DataError arrives wrapped; keep its message, drop Ray's trace
        raise DataError(_root_message(e)) from None


def _root_message(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


def _read_window(info: DatasetInfo, split: str, seed: int, shuffle: bool, epoch: int, window: int,
                 rows) -> list[pa.Table]:
    """Runs in a Ray Data read task: decode the window's row groups, shuffle, keep this rank's rows."""
    reader = SplitReader(info, split, seed=seed, shuffle=shuffle)
    order = reader.order(epoch)
    return [reader.window_rows(order, window).take(pa.array(order.row_permutation(window)[rows]))]


class PlannedParquet(Datasource):
    """One read task per window of the epoch plan that holds rows of this rank, in plan order."""

    def __init__(self, info: DatasetInfo, split: str, *, seed: int, shuffle: bool, epoch: int, offset: int,
                 global_batch: int, dp_rank: int, dp_size: int):
        super().__init__()
        self.info, self.split, self.seed, self.shuffle, self.epoch = info, split, seed, shuffle, epoch
        order = SplitReader(info, split, seed=seed, shuffle=shuffle).order(epoch)
        self.steps = steps_per_epoch(order.num_rows - offset, global_batch)
        self.files = [[info.splits[split][order.row_groups[g].shard].file for g in w] for w in order.windows]
        self.reads = []
        for window in range(len(order.windows)):
            rows = rank_rows_in_window(order, window, offset=offset, global_batch=global_batch,
                                       dp_rank=dp_rank, dp_size=dp_size)
            if len(rows):
                self.reads.append((window, rows))

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list:
        return [ReadTask(functools.partial(_read_window, self.info, self.split, self.seed, self.shuffle,
                                           self.epoch, window, rows),
                         BlockMetadata(num_rows=len(rows), size_bytes=None, exec_stats=None,
                                       input_files=tuple(sorted(set(self.files[window])))))
                for window, rows in self.reads]

