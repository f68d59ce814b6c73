"""The shard reader both loaders share: a split's rows in one epoch's order, read with pyarrow.

`SplitReader` opens shards (a few dozen kept open), checks each against the manifest's schema,
and decodes only the row groups that the rows asked of it come from (raydl.data.order: a rank's
rows of a step come from its lanes' row groups), keeping the last `CACHED_GROUPS` decoded with
their shuffled order. It hands out rows as `Piece`s (a decoded row group and the indices taken from
it), which the loader copies once into the step's tensors (raydl.data.pieces). `decoded_bytes`
counts what it decoded (the tables' buffer sizes), for the ingest bench and its test. The arrow
backend calls it in the training process's prefetch thread (raydl.data.loader), the ray backend in
Ray Data read tasks (raydl.data.ray_source).

Each shard is checked against its sha256 in the manifest when a process first opens it: the
whole file (from an object store: downloaded once, into memory) is hashed on the reading thread
(the prefetch thread or a read task, so it overlaps training) before any of its rows are used, and
once per process, shard and file version.

A shard that cannot be read or does not match its checksum fails with a DataError naming it,
unless `data.max_bad_shards` allows skipping it: then its rows are masked placeholders (id -1,
labels -100, which the losses ignore), so batch shapes and every other row's position stay the same.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydl.checksum import sha256_stream
from raydl.data.columns import is_variable_list, tensor_shape
from raydl.data.dataset import IGNORE_LABEL, DatasetInfo, schema_dict
from raydl.data.order import LANES, EpochOrder, RowGroup, Run
from raydl.data.pieces import Decoded, Piece
from raydl.errors import DataError, one_line

log = logging.getLogger(__name__)

OPEN_SHARDS = 64
# A step takes rows of at most two row groups per lane (the lane's current one and, at its end, the
# next); two more spare a re-decode where a rank's edge lane moves between steps. Reading ahead keeps
# each lane's next group as well.
CACHED_GROUPS = 2 * LANES + 2
READ_AHEAD_GROUPS = LANES

# (path, size, mtime, sha256) of the shard files this process has hashed and found intact. Per
# process, not per reader: a Ray Data read task builds a reader for a few dozen row groups, and its
# worker process runs many such tasks.
_VERIFIED: set[tuple[str, int, int, str]] = set()


class ChecksumMismatch(Exception):
    """A shard's bytes do not hash to the sha256 that manifest.json records for it."""


def verify(f: pa.NativeFile, path: str, *, expected: str, mtime_ns: int) -> None:
    """Hash the open shard `f` unless this process has already checked this version of it."""
    key = (path, f.size(), mtime_ns, expected)
    if key in _VERIFIED:
        return
    digest = sha256_stream(f)
    if digest != expected:
        raise ChecksumMismatch(f"its sha256 is {digest[:16]}..., not the {expected[:16]}... that manifest.json "
                               f"records: the file was changed or corrupted")
    _VERIFIED.add(key)


class SplitReader:
    """Random access to a split's rows in one epoch's order, a few row groups in memory at a time."""

    def __init__(self, info: DatasetInfo, split: str, *, seed: int, shuffle: bool, max_bad_shards: int = 0,
                 decode_threads: bool = True, read_ahead: bool = False):
        """`decode_threads`: decode a row group's columns on Arrow's CPU pool, as plain pyarrow does by default
        (raydl bench ingest, arrow path: 0.78 -> 0.81 of it); Ray Data read tasks, which run in parallel
        already, decode on their own thread.

        `read_ahead`: every row group is decoded on a thread of this reader's, so that `read_ahead(...)` can
        start on the coming steps' groups while the caller copies this step's rows out of theirs (decoding
        releases the GIL; the copy and the per-step Python keep the calling thread busy meanwhile)."""
        self.info, self.split, self.seed, self.shuffle = info, split, seed, shuffle
        self.decode_threads = decode_threads
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="raydl-decode") if read_ahead else None
        self._cached_groups = CACHED_GROUPS + (READ_AHEAD_GROUPS if read_ahead else 0)
        self.shards, self.paths = info.splits[split], info.shard_paths[split]
        self.row_groups = tuple(RowGroup(s, i, n) for s, shard in enumerate(self.shards)
                                for i, n in enumerate(shard.row_groups))
        # Rows of the epoch sequence worth reading ahead of a step: one row group per lane.
        self.read_ahead_rows = READ_AHEAD_GROUPS * max((g.rows for g in self.row_groups), default=0) if read_ahead else 0
        self.fs, self.root = info.filesystem()
        self.max_bad_shards = max_bad_shards
        self.bad_shards: set[str] = set()
        self.schema: pa.Schema | None = None      # of the first shard read; every other must match
        self.decoded_bytes = 0
        # (epoch, row group) -> its decoded rows as stored (or their decoding, under way) and their order in the
        # epoch (None: as stored), least recently used first
        self._groups: collections.OrderedDict[tuple[int, int], tuple[Decoded | Future, np.ndarray | None]] = \
            collections.OrderedDict()
        self._order: EpochOrder | None = None
        # Shards kept open: the shuffled lanes hop between shards, and reopening re-parses the footer.
        self._files: collections.OrderedDict[str, pq.ParquetFile] = collections.OrderedDict()

    def order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order.epoch != epoch:     # keep its cached permutations
            self._order = EpochOrder(self.row_groups, self.seed, epoch, self.shuffle)
        return self._order

    def _read_row_group(self, g: RowGroup) -> pa.Table:
        path = self.paths[g.shard]
        if path in self.bad_shards:
            return self._placeholder(g.rows)
        try:
            table = self._open(g.shard).read_row_group(g.index, use_threads=self.decode_threads)
        except (OSError, pa.ArrowException, ChecksumMismatch) as e:
            return self._skip(path, g, e)
        self.decoded_bytes += table.get_total_buffer_size()     # a sum; nbytes walked the buffers: 9% of an epoch
        return table

    def _open(self, shard: int) -> pq.ParquetFile:
        path = self.paths[shard]
        if path in self._files:
            self._files.move_to_end(path)
        else:
            self._files[path] = pq.ParquetFile(self._open_verified(shard))
            self._check_schema(path, self._files[path].schema_arrow)
            if len(self._files) > OPEN_SHARDS:
                self._files.popitem(last=False)
        return self._files[path]

    def _open_verified(self, shard: int) -> pa.NativeFile:
        path, sha256 = self.paths[shard], self.shards[shard].sha256
        f = self.fs.open_input_file(path)
        mtime_ns = self.fs.get_file_info(path).mtime_ns or 0
        remote = not isinstance(self.fs, pafs.LocalFileSystem)
        if remote and sha256 and (path, f.size(), mtime_ns, sha256) not in _VERIFIED:
            # One download, hashed and then decoded from memory: hashing the remote file and then reading its
            # row groups would fetch it twice (a shard is data.shard_rows rows, a few MB). Once checked, this
            # process reads only the row groups it needs (Ray Data's read tasks open a shard for a few).
            with f:
                f = pa.BufferReader(f.read_buffer())
        try:
            if sha256:      # hash the very file handle that is then read: what is checked is what is used
                verify(f, path, expected=sha256, mtime_ns=mtime_ns)
        except BaseException:
            f.close()
            raise
        return f

    def _check_schema(self, path: str, schema: pa.Schema) -> None:
        expected = self.info.meta["schema"]
        if schema_dict(schema) != expected:
            diff = sorted(set(schema_dict(schema).items()) ^ set(expected.items()))
            raise DataError(f"shard '{path}' has a different schema from the one in '{self.root}/manifest.json' "
                            f"(differing fields: {', '.join(f'{k}: {v}' for k, v in diff)}). Fix: re-create the "
                            f"dataset with `raydl data prepare`, which writes one schema for all shards.")
        self.schema = self.schema or schema.remove_metadata()

    def _skip(self, path: str, g: RowGroup, error: Exception) -> pa.Table:
        if len(self.bad_shards) >= self.max_bad_shards:
            raise DataError(f"shard '{path}' (row group {g.index}) cannot be read: {one_line(error)}. Skipped so far: "
                            f"{len(self.bad_shards)}, data.max_bad_shards={self.max_bad_shards}. Fix: re-create the "
                            f"dataset with `raydl data prepare`, or raise data.max_bad_shards to skip bad shards "
                            f"(their rows are left out).")
        log.warning(f"skipping unreadable shard '{path}' ({len(self.bad_shards) + 1}/{self.max_bad_shards} "
                    f"allowed by data.max_bad_shards): {one_line(error)}")
        self.bad_shards.add(path)
        return self._placeholder(g.rows)

    def _placeholder(self, rows: int) -> pa.Table:
        if self.schema is None:    # nothing read yet: take the schema from any readable shard's footer
            self.schema = self._any_schema()
        columns = {}
        for field in self.schema:
            # placeholder rows add nothing to loss or gradient
            fill = -1 if field.name == "id" else IGNORE_LABEL if field.name in ("label", "labels") else 0
            if pa.types.is_fixed_size_list(field.type):
                n = field.type.list_size
                values = pa.array(np.full(rows * n, fill), field.type.value_type)
                columns[field.name] = pa.FixedSizeListArray.from_arrays(values, n)
            elif is_variable_list(field.type):    # empty rows: all padding, masked out
                columns[field.name] = pa.array([[]] * rows, field.type)
            elif tensor_shape(field.type) is None:  # strings, structs: no model reads them
                columns[field.name] = pa.nulls(rows, field.type)
            else:
                columns[field.name] = pa.array(np.full(rows, fill), field.type)
        return pa.table(columns, schema=self.schema)

    def _any_schema(self) -> pa.Schema:
        for path in self.paths:
            try:
                with self.fs.open_input_file(path) as f:
                    return pq.read_schema(f).remove_metadata()
            except (OSError, pa.ArrowException):
                self.bad_shards.add(path)
        raise DataError(f"no shard of the {self.split} split of '{self.root}' can be read. Fix: re-create the "
                        f"dataset with `raydl data prepare`.")

    def group(self, order: EpochOrder, group: int) -> tuple[Decoded, np.ndarray | None]:
        """Row group `group` decoded, and the order of its rows in the epoch (None: as stored)."""
        key = (order.epoch, group)
        decoded, permutation = self._start(order, group)
        if isinstance(decoded, Future):
            decoded = decoded.result()      # a DataError of the decoding thread is raised here
            self._groups[key] = (decoded, permutation)
        return decoded, permutation

    def read_ahead(self, order: EpochOrder, runs: list[Run]) -> None:
        """Start decoding the row groups of `runs` that are not in memory yet; nothing for a reader made without
        read_ahead."""
        if self._decoder is None:
            return
        for group in dict.fromkeys(run.group for run in runs):
            self._start(order, group)

    def _start(self, order: EpochOrder, group: int) -> tuple[Decoded | Future, np.ndarray | None]:
        key = (order.epoch, group)
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        row_group = order.row_groups[group]
        decoding = (self._decoder.submit(self._decode, row_group) if self._decoder
                    else self._decode(row_group))
        self._groups[key] = (decoding, order.row_permutation(group) if order.shuffle else None)
        if len(self._groups) > self._cached_groups:
            self._groups.popitem(last=False)
        return self._groups[key]

    def _decode(self, row_group: RowGroup) -> Decoded:
        return Decoded(self._read_row_group(row_group))

    def piece(self, order: EpochOrder, group: int, start: int, length: int) -> Piece:
        """Rows [start, start + length) of row group `group` in the epoch's order."""
        decoded, permutation = self.group(order, group)
        return Piece(decoded, slice(start, start + length) if permutation is None else permutation[start:start + length])

    def gather(self, order: EpochOrder, runs: list[Run]) -> list[Piece]:
        return [self.piece(order, run.group, run.start, run.length) for run in runs]

    def rows(self, order: EpochOrder, start: int, end: int) -> list[Piece]:
        """Rows [start, end) of the epoch sequence."""
        return self.gather(order, order.sequence_runs(start, end))
