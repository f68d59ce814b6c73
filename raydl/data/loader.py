"""Worker-side loader: this rank's rows of each global step, read ahead on a thread.

It reads parquet row groups with pyarrow (local or remote filesystem), caches the window it
is in, and yields `StepBatch`es carrying the data position *after* the step, which is what
a checkpoint records. The time a step waits in `next()` is the data-wait metric.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raydl.data.dataset import DatasetInfo
from raydl.data.order import DataPosition, EpochOrder, RowGroup, rank_slice, steps_per_epoch
from raydl.errors import DataError


@dataclass
class StepBatch:
    tensors: dict[str, torch.Tensor]   # this rank's rows: column -> (rows, ...) tensor
    position: DataPosition             # where the sequence stands after this step
    wait_s: float = 0.0


def to_tensors(table: pa.Table, meta: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            arr = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
        else:
            arr = col.to_numpy(zero_copy_only=False)
        out[name] = torch.from_numpy(np.array(arr, copy=not arr.flags.writeable, order="C"))
    if "image" in out:
        out["image"] = out["image"].view(-1, *meta["image_shape"])
    return out


class SplitReader:
    """Random access to a split's rows in one epoch's order, one window in memory at a time."""

    def __init__(self, info: DatasetInfo, split: str, *, seed: int, shuffle: bool):
        self.info, self.split, self.seed, self.shuffle = info, split, seed, shuffle
        self.shards = info.splits[split]
        self.row_groups = tuple(RowGroup(s, i, n) for s, shard in enumerate(self.shards)
                                for i, n in enumerate(shard.row_groups))
        self.fs, self.root = info.filesystem()
        self._cache: tuple[tuple[int, int], pa.Table] | None = None

    def order(self, epoch: int) -> EpochOrder:
        return EpochOrder(self.row_groups, self.seed, epoch, self.shuffle)

    def _read_row_group(self, g: RowGroup) -> pa.Table:
        path = f"{self.root.rstrip('/')}/{self.shards[g.shard].file}"
        try:
            with self.fs.open_input_file(path) as f:
                return pq.ParquetFile(f).read_row_group(g.index)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"shard '{path}' (row group {g.index}) cannot be read: {e}. Fix: re-create the dataset "
                            f"with `raydl data prepare`, or remove the shard and its manifest entry.") from None

    def _window(self, order: EpochOrder, window: int) -> pa.Table:
        key = (order.epoch, window)
        if self._cache is None or self._cache[0] != key:
            table = pa.concat_tables([self._read_row_group(order.row_groups[g]) for g in order.windows[window]])
            self._cache = (key, table.take(pa.array(order.row_permutation(window))))
        return self._cache[1]

    def rows(self, order: EpochOrder, start: int, end: int) -> pa.Table:
        """Rows [start, end) of the epoch sequence."""
        parts = []
        while start < end:
            window, offset = order.locate(start)
            table = self._window(order, window)
            take = min(end - start, table.num_rows - offset)
            parts.append(table.slice(offset, take))
            start += take
        return pa.concat_tables(parts)


class StepLoader:
    """Yields this rank's slice of every global step from `position` on, for `max_epochs` (0 = forever)."""

    def __init__(self, info: DatasetInfo, *, global_batch: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool, position: DataPosition, prefetch: int = 2, split: str = "train"):
        self.reader = SplitReader(info, split, seed=seed, shuffle=shuffle)
        self.meta = info.meta
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.position = position
        self.prefetch = prefetch
        self.steps_per_epoch = steps_per_epoch(self.reader.order(0).num_rows, global_batch)
        if self.steps_per_epoch == 0:
            raise DataError(f"the {split} split has {self.reader.order(0).num_rows} rows, fewer than one global batch "
                            f"({global_batch}). Fix: lower train.global_batch_size or add data.")

    def _produce(self) -> Iterator[StepBatch]:
        epoch, offset = self.position.epoch, self.position.offset
        while True:
            order = self.reader.order(epoch)
            if offset + self.global_batch > order.num_rows:       # drop_last: same for every world size
                epoch, offset = epoch + 1, 0
                continue
            start, end = rank_slice(offset, global_batch=self.global_batch, dp_rank=self.dp_rank, dp_size=self.dp_size)
            tensors = to_tensors(self.reader.rows(order, start, end), self.meta)
            offset += self.global_batch
            yield StepBatch(tensors, DataPosition(epoch, offset))

    def __iter__(self) -> Iterator[StepBatch]:
        if self.prefetch == 0:
            yield from self._timed(iter(self._produce()))
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work():
            try:
                for item in self._produce():
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            except BaseException as e:   # hand reader errors to the training thread
                q.put(e)

        thread = threading.Thread(target=work, daemon=True, name="raydl-prefetch")
        thread.start()
        try:
            yield from self._timed(iter(q.get, None))
        finally:
            stop.set()

    @staticmethod
    def _timed(items) -> Iterator[StepBatch]:
        while True:
            t0 = time.perf_counter()
            item = next(items)
            if isinstance(item, BaseException):
                raise item
            item.wait_s = time.perf_counter() - t0
            yield item


def eval_batches(info: DatasetInfo, *, batch: int, dp_rank: int, dp_size: int, max_batches: int) -> Iterator[dict]:
    """The first `max_batches` micro-batches of this rank's share of the eval split, in file order."""
    reader = SplitReader(info, "eval", seed=0, shuffle=False)
    order = reader.order(0)
    per_step = batch * dp_size
    for i in range(min(max_batches, order.num_rows // per_step)):
        start = i * per_step + dp_rank * batch
        yield to_tensors(reader.rows(order, start, start + batch), info.meta)
