"""The loader on real parquet: deterministic order, bad shards (unreadable or failing their checksum: fail
naming the file, or skip exactly once), no shard read from outside the dataset, the debug ledger hook."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydl.bench.ingest import dataset_decoded_bytes
from raydl.checksum import sha256_file
from raydl.data.dataset import open_dataset
from raydl.data.ledger import Ledger
from raydl.data.loader import StepLoader, eval_batches
from raydl.data.order import DataPosition
from raydl.data.shards import SplitReader
from raydl.data.prepare import prepare
from raydl.errors import ConfigError, DataError
from raydl.overrides import load_config
from raydl.train.hold import hold_after

GB = 64


def make_dataset(tmp_path: Path, shards: int = 4, rows: int = 512) -> Path:
    """`shards` train shards of `rows` rows (token rows whose first value is the row's own id)."""
    src = tmp_path / "src.parquet"
    n = shards * rows + (shards * rows + 14) // 15     # prepare sends every 16th row to eval
    x = np.repeat(np.arange(n), 4).reshape(n, 4)
    pq.write_table(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
                             "labels": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4)}), src)
    out = tmp_path / "ds"
    prepare("parquet", str(src), str(out), shard_rows=rows, progress=False)
    return out


def epoch_ids(path: Path, dp_size: int, *, epoch: int = 0, seed: int = 0, **kw) -> tuple[list[list[int]], list]:
    """Ids each rank gets in one epoch, per step, and the batches of rank 0."""
    info = open_dataset(str(path))
    per_rank, batches = [], []
    for r in range(dp_size):
        loader = StepLoader(info, global_batch=GB, dp_rank=r, dp_size=dp_size, seed=seed, shuffle=True,
                            position=DataPosition(epoch, 0), prefetch=1, **kw)
        steps = []
        for batch, _ in zip(loader, range(loader.steps_per_epoch)):
            steps.append(batch.tensors["id"].tolist())
            batches.append(batch) if r == 0 else None
        per_rank.append(steps)
    return per_rank, batches


def flat(per_rank) -> list[int]:
    return [i for steps in zip(*per_rank) for rank_ids in steps for i in rank_ids]


def train_ids(path: Path) -> set[int]:
    return {i for f in sorted(path.glob("train-*.parquet")) for i in pq.read_table(f)["id"].to_pylist()}


def test_loader_reads_the_epoch_once_deterministically(tmp_path):
    path = make_dataset(tmp_path)
    one, batches = epoch_ids(path, 1)
    two, _ = epoch_ids(path, 2)
    assert flat(one) == flat(two)                        # the sequence does not depend on the world size
    assert sorted(flat(one)) == sorted(train_ids(path)) and len(flat(one)) == 2048
    assert flat(epoch_ids(path, 1, epoch=1)[0]) != flat(one)
    assert flat(epoch_ids(path, 1, seed=0)[0]) == flat(one)
    assert (batches[0].tensors["input_ids"][:, 0] == batches[0].tensors["id"]).all()   # rows stay whole


def corrupt(path: Path, shard: int) -> Path:
    f = path / f"train-{shard:05d}.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])     # a truncated upload
    return f


def test_corrupt_shard_fails_with_its_name(tmp_path):
    path = make_dataset(tmp_path)
    bad = corrupt(path, 2)
    with pytest.raises(DataError, match=rf"shard '{bad}'.*data.max_bad_shards=0.*Fix:"):
        epoch_ids(path, 2)


def test_skipped_shard_keeps_the_other_rows_exactly_once(tmp_path, caplog):
    path = make_dataset(tmp_path)
    lost = set(pq.read_table(path / "train-00002.parquet")["id"].to_pylist())
    expected = train_ids(path) - lost
    bad = corrupt(path, 2)
    with caplog.at_level(logging.WARNING, logger="raydl"):
        per_rank, batches = epoch_ids(path, 2, max_bad_shards=1)
    skipped = [r for r in caplog.records if r.name.startswith("raydl.") and "skipping unreadable shard" in r.message]
    assert skipped and all(f"'{bad}'" in r.message and "data.max_bad_shards" in r.message for r in skipped)
    ids = flat(per_rank)
    good = [i for i in ids if i >= 0]
    assert len(good) == len(set(good)) and set(good) == expected
    assert ids.count(-1) == len(lost)                    # placeholders hold the bad rows' places
    placeholder = batches[-1].tensors["id"] == -1
    assert batches[-1].bad_shards == 1 and (batches[-1].tensors["labels"][placeholder] == -100).all()
    assert [b.tensors["id"].shape for b in batches] == [(GB // 2,)] * len(batches)     # shapes unchanged
    with pytest.raises(DataError, match="train-00003.parquet"):
        corrupt(path, 3)
        epoch_ids(path, 2, max_bad_shards=1)


def rehash(path: Path, shard: Path) -> None:
    """Record `shard`'s current sha256 in the manifest, as if whoever changed it had updated that too."""
    manifest = json.loads((path / "manifest.json").read_text())
    for entry in manifest["splits"]["train"]["shards"]:
        if entry["file"] == shard.name:
            entry["sha256"] = sha256_file(shard)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_shard_with_another_schema_is_named(tmp_path):
    path = make_dataset(tmp_path)
    f = path / "train-00001.parquet"
    table = pq.read_table(f)
    pq.write_table(table.set_column(1, "input_ids", pa.array(table["input_ids"].to_pylist(),
                                                                     pa.list_(pa.int64()))), f, row_group_size=256)
    rehash(path, f)       # its checksum matches: only the schema is wrong
    with pytest.raises(DataError, match=rf"shard '{f}' has a different schema.*input_ids: list<"):
        epoch_ids(path, 1)


def test_ledger_hook_records_the_steps_and_fails_once(tmp_path):
    path, ledger_dir = make_dataset(tmp_path), tmp_path / "ledger"   # made by the first loader
    cfg = load_config(None, [f"debug.ledger_dir={ledger_dir}", "debug.fail_at_step=3"])
    hook = Ledger.from_config(cfg.debug)
    loader = StepLoader(open_dataset(str(path)), global_batch=GB, dp_rank=0, dp_size=1, seed=0, shuffle=True,
                        position=DataPosition(0, 0), prefetch=0, ledger=hook)
    steps = iter(loader)
    taken = [next(steps).tensors["id"].tolist() for _ in range(2)]
    with pytest.raises(RuntimeError, match="debug.fail_at_step: injected failure at step 3"):
        next(steps)
    [header, *records] = [json.loads(x) for x in next(ledger_dir.glob("ledger-*-dp0.jsonl")).read_text().splitlines()]
    assert header["start"] == {"epoch": 0, "offset": 0} and [r["ids"] for r in records] == taken
    again = StepLoader(open_dataset(str(path)), global_batch=GB, dp_rank=0, dp_size=1, seed=0, shuffle=True,
                       position=DataPosition(0, 2 * GB), prefetch=0, ledger=hook)
    assert next(iter(again)).position.offset == 3 * GB          # the failure fires once per ledger dir
    assert Ledger.from_config(load_config(None, []).debug) is None     # debug off: the loader gets no hook


@pytest.mark.parametrize("sets, field, problem", [
    (["debug.fail_at_step=0"], "fail_at_step", "use -1 (off) or a step >= 1"),
    (["debug.fail_at_step=5"], "fail_at_step", "needs debug.ledger_dir"),
    (["debug.peer_copy_hold_s=-1", "debug.ledger_dir=x"], "peer_copy_hold_s", "use 0 (off) or seconds > 0"),
    (["debug.peer_copy_hold_s=5"], "peer_copy_hold_s", "needs debug.ledger_dir"),
    (["debug.hold_at_step=0", "debug.ledger_dir=x"], "hold_at_step", "use -1 (off) or a step >= 1"),
    (["debug.hold_at_step=5"], "hold_at_step", "needs debug.ledger_dir"),
])
def test_debug_section_is_validated(sets, field, problem):
    with pytest.raises(ConfigError, match=rf"config field 'debug.{field}'.*{re.escape(problem)}"):
        load_config(None, sets)


def test_a_hold_marks_each_rank_and_ends_at_the_release_or_a_drain_notice(tmp_path):
    debug = load_config(None, [f"debug.ledger_dir={tmp_path}", "debug.hold_at_step=30"]).debug
    hold_after(29, debug, notice=lambda: pytest.fail("held at a step that is not debug.hold_at_step"))
    assert not list(tmp_path.glob("held-*"))
    notices = iter([False, False, True])
    hold_after(30, debug, notice=lambda: next(notices))     # a drain notice on the third look
    assert [p.name for p in tmp_path.glob("held-*")] == [f"held-{os.getpid()}"]
    assert next(notices, "spent") == "spent"
    (tmp_path / "release").touch()
    hold_after(30, debug, notice=lambda: False)             # released: returns at once


def flip_a_byte_silently(shard: Path) -> None:
    """Change one byte of `shard` so that it still reads as valid parquet, with other values: what a bit flip
    on disk or in transit can do, and what training would otherwise take in without a word."""
    original, table = shard.read_bytes(), pq.read_table(shard)
    for offset in range(len(original) // 4, len(original)):
        changed = bytearray(original)
        changed[offset] ^= 0x01
        shard.write_bytes(changed)
        try:
            if not pq.read_table(shard).equals(table):
                return
        except (OSError, pa.ArrowException):
            pass
    raise AssertionError(f"no byte of {shard} changes its values and keeps it readable")


def test_a_changed_byte_fails_the_checksum_and_counts_as_a_bad_shard(tmp_path):
    path = make_dataset(tmp_path)
    bad = path / "train-00001.parquet"
    lost = len(pq.read_table(bad))
    flip_a_byte_silently(bad)
    with pytest.raises(DataError, match=rf"shard '{bad}'.*sha256.*changed or corrupted.*data.max_bad_shards=0"):
        epoch_ids(path, 1)
    per_rank, batches = epoch_ids(path, 2, max_bad_shards=1)
    assert flat(per_rank).count(-1) == lost and batches[-1].bad_shards == 1


@pytest.mark.parametrize("entry", ["../outside.parquet", "/etc/passwd", "link.parquet"])
def test_the_loader_reads_no_shard_outside_the_dataset(tmp_path, entry):
    path = make_dataset(tmp_path)
    (tmp_path / "outside.parquet").write_bytes((path / "train-00000.parquet").read_bytes())
    (path / "link.parquet").symlink_to(tmp_path / "outside.parquet")
    info = open_dataset(str(path))
    shards = (dataclasses.replace(info.splits["train"][0], file=entry), *info.splits["train"][1:])
    hostile = dataclasses.replace(info, splits={**info.splits, "train": shards})
    with pytest.raises(DataError, match=rf"entry splits.train.shards\[0\].file = '{re.escape(entry)}' is not a file "
                                        rf"inside the dataset directory"):
        StepLoader(hostile, global_batch=GB, dp_rank=0, dp_size=1, seed=0, shuffle=True, position=DataPosition())


def rank_epoch(info, *, global_batch: int, dp_rank: int, dp_size: int, start: DataPosition,
               steps: int) -> tuple[list[int], int]:
    """Ids of `steps` steps of one rank from `start`, and the bytes its reader decoded for them."""
    loader = StepLoader(info, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size, seed=2, shuffle=True,
                        position=start, prefetch=0)
    ids = [i for _, batch in zip(range(steps), loader) for i in batch.tensors["id"].tolist()]
    return ids, loader.reader.decoded_bytes


@pytest.mark.parametrize("dp", [2, 4])
def test_each_rank_decodes_about_its_share_of_the_rows(tmp_path, dp):
    path = make_dataset(tmp_path, shards=8, rows=640)        # row groups of 256, 256 and 128 rows
    info, total = open_dataset(str(path)), dataset_decoded_bytes(path)
    steps = 5120 // GB
    ranks = [rank_epoch(info, global_batch=GB, dp_rank=r, dp_size=dp, start=DataPosition(), steps=steps)
             for r in range(dp)]
    ids = [i for rank_ids, _ in ranks for i in rank_ids]
    assert len(ids) == len(set(ids)) and set(ids) == train_ids(path)
    shares = [decoded / total for _, decoded in ranks]
    assert all(share <= 1 / dp + 0.10 for share in shares), shares


def test_a_resize_mid_epoch_reads_the_epoch_exactly_once(tmp_path):
    path = make_dataset(tmp_path, shards=8, rows=640)
    info, gb = open_dataset(str(path)), 96                    # divisible by 2 and by 3
    steps, half = 5120 // gb, 5120 // gb // 2
    ids = [i for r in range(2) for i in rank_epoch(info, global_batch=gb, dp_rank=r, dp_size=2,
                                                   start=DataPosition(), steps=half)[0]]
    ids += [i for r in range(3) for i in rank_epoch(info, global_batch=gb, dp_rank=r, dp_size=3,
                                                    start=DataPosition(0, half * gb), steps=steps - half)[0]]
    assert len(ids) == len(set(ids)) == steps * gb and set(ids) <= train_ids(path)


def test_eval_ranks_take_contiguous_runs_of_the_same_rows(tmp_path):
    path = make_dataset(tmp_path)                  # 137 eval rows: 2 micro-batches of 32 per rank at dp=2
    info = open_dataset(str(path))
    first = pq.read_table(next(path.glob("eval-*.parquet")))["id"].to_pylist()[:2 * 32 * 2]
    ranks = [[i for b in eval_batches(info, batch=32, dp_rank=r, dp_size=2, max_batches=4) for i in b["id"].tolist()]
             for r in range(2)]
    assert ranks == [first[:64], first[64:]]       # the first 4 micro-batches, as before; each rank a run of them


def test_reading_ahead_decodes_later_steps_groups_and_hands_out_the_same_rows(tmp_path, monkeypatch):
    path = make_dataset(tmp_path, shards=8, rows=640)
    info = open_dataset(str(path))
    steps = 2 * (5120 // GB)                                   # two epochs
    # Per reader: the first loader's decoding thread may still finish a group it started while the second runs.
    decodes: collections.defaultdict[SplitReader, collections.Counter] = collections.defaultdict(collections.Counter)
    read_row_group = SplitReader._read_row_group

    def counted(self, g):
        decodes[self][g.shard, g.index] += 1
        return read_row_group(self, g)
    monkeypatch.setattr(SplitReader, "_read_row_group", counted)

    def batches(prefetch: int) -> tuple[list[list[int]], StepLoader, collections.Counter]:
        loader = StepLoader(info, global_batch=GB, dp_rank=0, dp_size=2, seed=3, shuffle=True,
                            position=DataPosition(0, 5 * GB), prefetch=prefetch)
        ids = [b.tensors["id"].tolist() for b, _ in zip(loader, range(steps))]
        return ids, loader, collections.Counter(decodes[loader.reader])

    ahead, loader, ahead_decodes = batches(2)
    assert loader.reader.read_ahead_rows == 8 * 256
    plain, unread, plain_decodes = batches(0)
    assert ahead == plain and unread.reader.read_ahead_rows == 0
    # Reading ahead evicts nothing still needed: each group once per epoch, and at most once more for the
    # epoch the prefetch thread has started on when the test stops taking steps.
    assert all(ahead_decodes[g] - plain_decodes[g] in (0, 1) for g in ahead_decodes | plain_decodes)

    reader = loader.reader                                     # a fresh epoch: the first step asks for more
    order = reader.order(7)
    first, *later = order.steps_runs(0, steps=40, global_batch=GB, dp_rank=0, dp_size=1)
    for runs in [first, *later]:
        reader.read_ahead(order, runs)
    needed = {run.group for run in first}
    started = {group for epoch, group in reader._groups if epoch == 7}
    assert needed < started, "the groups of the steps after the first were not started"
    assert [len(p) for p in reader.gather(order, first)] == [run.length for run in first]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loader_of_n_steps_hands_out_those_steps_and_ends(tmp_path, prefetch):
    info = open_dataset(str(make_dataset(tmp_path)))
    start = DataPosition(0, 28 * GB)

    def loader(steps):
        return StepLoader(info, global_batch=GB, dp_rank=0, dp_size=2, seed=0, shuffle=True, position=start,
                          prefetch=prefetch, steps=steps)

    unbounded = loader(None)
    first = [(b.position, b.tensors["id"].tolist()) for _, b in zip(range(10), unbounded)]
    assert unbounded.steps_per_epoch == 32                          # so the 10 steps cross into epoch 1
    assert [(b.position, b.tensors["id"].tolist()) for b in loader(10)] == first
    assert first[-1][0] == DataPosition(1, 6 * GB)
    assert list(loader(0)) == []
