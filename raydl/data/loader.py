"""Worker-side loader: this rank's rows of each global step, read ahead on a thread.

The rows come from `SplitReader` (raydl.data.shards: pyarrow in this process, data.backend=arrow)
or from Ray Data read tasks (raydl.data.ray_source, data.backend=ray); both follow raydl.data.order.
The loader yields `StepBatch`es carrying the data position *after* the step, which is what
a checkpoint records. The time a step waits in `next()` is the data-wait metric.

A shard that cannot be read, or does not match its sha256 in the manifest (raydl.data.shards
checks each one when it first opens it), fails the run with a DataError naming it (the last
checkpoint stays valid), unless `data.max_bad_shards` allows skipping it: then its rows keep their
places in the epoch sequence as masked placeholders (id -1, labels -100, which the losses
ignore), so batch shapes and every other row's position stay the same on every rank and
after any restart: the remaining rows are still consumed exactly once.
"""

from __future__ import annotations

import collections
import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from raydl.data.columns import MASK_SUFFIX, VARIABLE, tensor_shape
from raydl.data.dataset import DatasetInfo
from raydl.data.ledger import Ledger
from raydl.data.order import DataPosition, EpochOrder, Run, steps_per_epoch
from raydl.data.preprocess import make_preprocess
from raydl.data.pieces import Piece, concat, gather
from raydl.data.prefetchers import PREFETCHERS
from raydl.data.shards import SplitReader
from raydl.errors import DataError


@dataclass
class StepBatch:
    tensors: dict[str, torch.Tensor]   # this rank's rows: column -> (rows, ...) tensor
    position: DataPosition             # where the sequence stands after this step
    wait_s: float = 0.0
    bad_shards: int = 0                # shards this rank has skipped so far (data.max_bad_shards)


def to_tensors(rows: pa.Table | list[Piece], meta: dict) -> dict[str, torch.Tensor]:
    """Every tensor column (raydl.data.columns) of `rows` (a table, or a step's pieces) as a tensor; a
    variable-length list column padded to the dataset's seq_len (or its longest row, if longer or the dataset
    has none), with its `<column>_mask`: every step then has the same shapes, which pipeline stages (their
    point-to-point buffers are sized at the first step), compiled blocks (one graph) and the memory prediction need.
    Columns no model can read (strings, structs) are left out."""
    pieces = [Piece.whole(rows)] if isinstance(rows, pa.Table) else rows
    schema, out, table = pieces[0].source.table.schema, {}, None
    for name, kind in zip(schema.names, schema.types):
        shape = tensor_shape(kind)
        if shape is None:
            continue
        if shape == [VARIABLE]:
            table = concat(pieces) if table is None else table    # once, however many such columns
            out[name], out[name + MASK_SUFFIX] = _padded(table.column(name).combine_chunks(), meta.get("seq_len", 0))
        else:
            out[name] = torch.from_numpy(gather(pieces, name))
    if "image" in out:
        out["image"] = out["image"].view(-1, *meta["image_shape"])
    return out


def _padded(col: pa.Array, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, max(width, longest)) values, zero after each row's end, and the bool mask of the real ones."""
    lengths = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False)
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    mask = np.arange(max(width, int(lengths.max(initial=0))))[None, :] < lengths[:, None]
    padded = np.zeros(mask.shape, dtype=values.dtype)
    padded[mask] = values      # row-major: each row's values fill its first `length` places
    return torch.from_numpy(padded), torch.from_numpy(mask)


def epoch_steps(info: DatasetInfo, global_batch: int, split: str = "train") -> int:
    """Global steps in an epoch of `split`: a final partial global batch is dropped."""
    return steps_per_epoch(info.rows(split), global_batch)


class StepLoader:
    """Yields this rank's slice of every global step from `position` on: `steps` of them (None: until the
    consumer stops).

    data.backend picks who reads: `arrow` reads this rank's row groups with pyarrow in this process
    (SplitReader); `ray` streams the same rows, in the same order, through Ray Data read tasks
    on the cluster's CPUs (raydl.data.ray_source). `ledger` (debug.ledger_dir, a test hook) records
    the ids of every step handed out; without one the loader does nothing extra per step.
    """

    def __init__(self, info: DatasetInfo, *, global_batch: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool, position: DataPosition, prefetch: int = 2, split: str = "train",
                 max_bad_shards: int = 0, backend: str = "arrow", augment: bool = False, read_cpus: float = 1.0,
                 ledger: Ledger | None = None, steps: int | None = None):
        self.info, self.split, self.seed, self.shuffle = info, split, seed, shuffle
        self.steps = steps
        # Reading ahead needs a thread that consumes the steps meanwhile (prefetch); without one, the bytes a
        # rank decodes stay those of the steps it was asked for.
        self.reader = SplitReader(info, split, seed=seed, shuffle=shuffle, max_bad_shards=max_bad_shards,
                                  read_ahead=prefetch > 0 and backend == "arrow")
        self.meta = info.meta
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.position = position
        self.prefetch = prefetch
        self.backend, self.augment, self.read_cpus = backend, augment, read_cpus
        self.steps_per_epoch = epoch_steps(info, global_batch, split)
        if self.steps_per_epoch == 0:
            raise DataError(f"the {split} split has {info.rows(split)} rows, fewer than one global batch "
                            f"({global_batch}). Fix: lower train.global_batch_size or add data.")
        self.ledger = ledger.open(dp_rank=dp_rank, dp_size=dp_size, start=position,
                                  steps_per_epoch=self.steps_per_epoch, global_batch=global_batch) if ledger else None

    def _produce(self) -> Iterator[StepBatch]:
        epoch, offset = self.position.epoch, self.position.offset
        for rows_epoch, rows in itertools.islice(self._step_rows(), self.steps):
            if rows_epoch != epoch:      # drop_last: a final partial global batch is skipped by every rank
                epoch, offset = rows_epoch, 0
            offset += self.global_batch
            yield StepBatch(to_tensors(rows, self.meta), DataPosition(epoch, offset),
                            bad_shards=len(self.reader.bad_shards))

    def _step_rows(self) -> Iterator[tuple[int, list[Piece]]]:
        """(epoch, this rank's preprocessed rows) of every step from `position` on."""
        if self.backend == "ray":
            from raydl.data.ray_source import stream     # imports ray: only for this backend

            yield from stream(self.info, self.split, start=self.position, seed=self.seed, shuffle=self.shuffle,
                              global_batch=self.global_batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                              augment=self.augment, prefetch=self.prefetch, read_cpus=self.read_cpus,
                              steps=self.steps)
            return
        epoch, offset = self.position.epoch, self.position.offset
        preprocess = make_preprocess(self.meta, augment=self.augment, seed=self.seed)
        while True:
            order = self.reader.order(epoch)
            steps = order.steps_runs(offset, steps=steps_per_epoch(order.num_rows - offset, self.global_batch),
                                     global_batch=self.global_batch, dp_rank=self.dp_rank, dp_size=self.dp_size)
            for runs in self._read_ahead(order, steps):
                rows = self.reader.gather(order, runs)
                yield epoch, [Piece.whole(preprocess(concat(rows), epoch))] if preprocess else rows
            epoch, offset = epoch + 1, 0

    def _read_ahead(self, order: EpochOrder, steps: Iterator[list[Run]]) -> Iterator[list[Run]]:
        """`steps`, each handed on once the reader has been asked to decode the row groups of the steps that
        follow it, up to every lane's next row group. The lanes advance together and cross into their next
        groups at about the same step: reading only one step ahead left the decoding thread idle in between."""
        window: collections.deque[list[Run]] = collections.deque()
        depth = math.ceil(self.reader.read_ahead_rows / self.global_batch)
        for runs in steps:
            self.reader.read_ahead(order, runs)
            window.append(runs)
            if len(window) > depth:
                yield window.popleft()
        yield from window

    def __iter__(self) -> Iterator[StepBatch]:
        if self.prefetch == 0:
            yield from self._timed(iter(self._produce()))
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def hand(item) -> bool:
            """Queue `item` unless the consumer has stopped; False once it has."""
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work():
            items = self._produce()
            try:
                if all(hand(item) for item in items):
                    hand(None)           # all `steps` handed out: the consumer's loop ends
            except BaseException as e:   # hand reader errors to the training thread
                hand(e)
            finally:
                items.close()            # stop the reader now (Ray Data's threads), not at garbage collection

        thread = threading.Thread(target=work, daemon=True, name="raydl-prefetch")
        thread.start()
        PREFETCHERS.append((stop, thread))
        try:
            yield from self._timed(iter(q.get, None))
        finally:
            stop.set()
            thread.join(timeout=10)
            if not thread.is_alive():       # one still in a read is joined again at exit
                PREFETCHERS.remove((stop, thread))

    def _timed(self, items) -> Iterator[StepBatch]:
        while True:
            t0 = time.perf_counter()
            item = next(items, None)
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            item.wait_s = time.perf_counter() - t0
            if self.ledger is not None:
                self.ledger.record(item.position, item.tensors["id"])
            yield item


def eval_batches(info: DatasetInfo, *, batch: int, dp_rank: int, dp_size: int, max_batches: int,
                 max_bad_shards: int = 0) -> Iterator[dict]:
    """This rank's micro-batches of the eval split's first `max_batches * dp_size` micro-batches (file
    order): a contiguous run of them, so that a rank decodes only the row groups of its own rows."""
    reader = SplitReader(info, "eval", seed=0, shuffle=False, max_bad_shards=max_bad_shards)
    order = reader.order(0)
    batches = min(max_batches, order.num_rows // (batch * dp_size))
    first = dp_rank * batches * batch
    for i in range(batches):
        start = first + i * batch
        yield to_tensors(reader.rows(order, start, start + batch), info.meta)
