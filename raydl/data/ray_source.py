"""`data.backend=ray`: the same exactly-once epoch sequence, with the windows read through Ray Data.

Why not `Dataset.streaming_split` (what Ray Train's `datasets=` uses): it hands blocks to the
ranks *dynamically* (whichever rank asks first gets the next block) and its iterator cannot
be resumed mid-epoch (no state_dict/skip; open request ray-project/ray#37633). After a
failure or a resize, Train re-creates the split from the start of the epoch, so rows would be
seen twice; and which rank saw which row is not reproducible, so a checkpoint cannot say
where to continue. raydl's position (`DataPosition`) instead fixes one global sequence
(raydl.data.order), so each rank knows which rows it needs before reading anything.

So each rank asks Ray Data only for what its slices need: the row groups of the next few
windows of the order plan. `read_parquet` reads those shards, a pushed-down `filter` on the
`id` ranges of the wanted row groups (from the footers' statistics) skips the others, and
the result is materialised
(`windows_per_read` windows per Ray Data execution, to pay its fixed start cost rarely) and
put back in plan order, so the rows, their order and the positions are bit-identical to the
arrow backend. The loader's prefetch thread overlaps these reads with compute.

Fast-read settings (RAY_NOTES P6): `RAY_DATA_PARQUET_FOOTER_NUM_ACTORS=1` (the V2 datasource
otherwise starts 32 footer actors per execution) is set here if the user has not set it;
`RAY_DATA_USE_DATASOURCE_V2=0` (V1 path) is the alternative. `raydl bench ingest` measures both.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydl.data.dataset import DatasetInfo
from raydl.data.loader import SplitReader
from raydl.data.order import EpochOrder, RowGroup
from raydl.errors import DataError

os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")


class RaySplitReader(SplitReader):
    """A SplitReader whose windows come from Ray Data, `windows_per_read` windows per execution."""

    def __init__(self, info: DatasetInfo, split: str, *, seed: int, shuffle: bool, max_bad_shards: int = 0,
                 windows_per_read: int = 4):
        super().__init__(info, split, seed=seed, shuffle=shuffle, max_bad_shards=max_bad_shards)
        import ray

        if not ray.is_initialized():
            raise DataError("data.backend=ray needs a Ray cluster, and this worker is not in one (torchrun?). "
                            "Fix: run with `raydl train`, or set data.backend=arrow.")
        self.windows_per_read = windows_per_read
        self._id_ranges: dict[RowGroup, tuple[int, int]] = {}
        self._windows: dict[tuple[int, int], pa.Table] = {}

    def _window(self, order: EpochOrder, window: int) -> pa.Table:
        key = (order.epoch, window)
        if key not in self._windows:
            last = min(window + self.windows_per_read, len(order.windows))
            self._windows = self._read_windows(order, range(window, last))
        return self._windows[key]

    def _read_windows(self, order: EpochOrder, windows: range) -> dict[tuple[int, int], pa.Table]:
        import ray.data
        from ray.data.expressions import col, lit

        groups = [order.row_groups[g] for w in windows for g in order.windows[w]]
        ranges = [self._id_range(g) for g in groups]
        wanted = None
        for lo, hi in ranges:
            term = (col("id") >= lit(lo)) & (col("id") <= lit(hi))
            wanted = term if wanted is None else wanted | term
        files = sorted({f"{self.root.rstrip('/')}/{self.shards[g.shard].file}" for g in groups})
        ds = ray.data.read_parquet(files, filesystem=self.fs, file_extensions=None).filter(expr=wanted)
        try:
            table = pa.concat_tables(ray.get(ds.to_arrow_refs())).sort_by("id")
        except Exception as e:   # Ray wraps reader errors; it does not say which file failed
            raise DataError(f"Ray Data could not read shards {', '.join(files)}: {str(e).splitlines()[-1][:300]}. "
                            f"Fix: find the bad shard with `raydl data inspect {self.root} --verify`, re-create "
                            f"it, or train with data.backend=arrow (which can skip it, data.max_bad_shards).") from None
        ids = table["id"].to_numpy()
        out = {}
        for w in windows:
            parts = []
            for g in order.windows[w]:
                lo, hi = self._id_range(order.row_groups[g])
                start, end = np.searchsorted(ids, [lo, hi + 1])
                if end - start != order.row_groups[g].rows:
                    raise DataError(f"row group {g} of '{self.root}' does not hold a sorted, disjoint id range, "
                                    f"which data.backend=ray needs to select it. Fix: re-create the dataset with "
                                    f"`raydl data prepare` or use data.backend=arrow.")
                parts.append(table.slice(start, end - start))
            window_table = pa.concat_tables(parts)
            out[(order.epoch, w)] = window_table.take(pa.array(order.row_permutation(w)))
        return out

    def _id_range(self, g: RowGroup) -> tuple[int, int]:
        """min/max id of a row group, from its shard's footer (read once per shard)."""
        if g not in self._id_ranges:
            path = f"{self.root.rstrip('/')}/{self.shards[g.shard].file}"
            with self.fs.open_input_file(path) as f:
                meta = pq.ParquetFile(f).metadata
            index = meta.schema.names.index("id")
            for i in range(meta.num_row_groups):
                stats = meta.row_group(i).column(index).statistics
                self._id_ranges[RowGroup(g.shard, i, meta.row_group(i).num_rows)] = (stats.min, stats.max)
        return self._id_ranges[g]

