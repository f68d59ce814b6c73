"""Property-based: `--set` overrides and dataset manifests from anywhere end in a result or a raydl error.

Each test draws 1,000 inputs per run: 20-45 s on 2 cores, so they run with the slow part (the fast part's
bad-input modules cover the same fields case by case). An exception other than raydl's own (one paragraph,
exit 2) is a bug: a bare traceback for the user.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raydl.config import JobConfig, iter_fields
from raydl.data.dataset import check_task, open_dataset
from raydl.data.order import steps_per_epoch
from raydl.errors import RaydlError
from raydl.overrides import load_config

pytestmark = pytest.mark.slow

FIELDS = [f"{s}.{f.name}" for s, f in iter_fields()]
SCALARS = st.one_of(st.integers(-10**12, 10**12).map(str), st.floats(allow_nan=True).map(repr),
                    st.sampled_from(["true", "false", "auto", "[1, 2]", "[", "{a: 1}", "~", "null", "'x", "1e999",
                                     "-0", "0x10", "nan", ".inf", "fp16", "gpt", "[2, 1]", "[[1]]", "", " "]),
                    st.text(max_size=12))
ASSIGNMENTS = st.one_of(
    st.tuples(st.sampled_from(FIELDS), SCALARS).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(alphabet=string.printable, max_size=30),
)
SETTINGS = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(ASSIGNMENTS, max_size=4))
def test_any_overrides_give_a_config_or_a_raydl_error(assignments):
    try:
        cfg = load_config(None, assignments)
    except RaydlError:
        return
    assert isinstance(cfg, JobConfig)


def _dataset_dir() -> Path:
    root = Path(tempfile.mkdtemp(prefix="raydl-prop-"))
    table = pa.table({"id": [0, 1], "input_ids": [[1, 2], [3, 4]], "labels": [[2, 3], [4, 5]]})
    pq.write_table(table, root / "train-00000.parquet")
    return root


VALID = {"format": 1, "task": "tokens", "vocab_size": 257, "seq_len": 2,
         "splits": {"train": {"rows": 2, "shards": [{"file": "train-00000.parquet", "rows": 2, "row_groups": [2]}]}}}
JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=False),
                              st.text(max_size=8), st.sampled_from(["../../etc/passwd", "/etc/passwd",
                                                                    "train-00000.parquet", "train", "tokens"])),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                    max_leaves=12)
PATHS = [("splits",), ("splits", "train"), ("splits", "train", "shards"), ("splits", "train", "shards", 0),
         ("splits", "train", "shards", 0, "file"), ("splits", "train", "shards", 0, "rows"),
         ("splits", "train", "shards", 0, "row_groups"), ("task",), ("vocab_size",), ("seq_len",), ("schema",)]


def _mutated(path: tuple, value) -> dict:
    manifest = json.loads(json.dumps(VALID))
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return manifest


MANIFESTS = st.one_of(JSON, st.tuples(st.sampled_from(PATHS), JSON).map(lambda pv: _mutated(*pv)))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MANIFESTS)
def test_any_manifest_gives_a_dataset_or_a_raydl_error(manifest):
    root = DATASET
    (root / "manifest.json").write_text(json.dumps(manifest))
    try:
        info = open_dataset(str(root))
        check_task(info, "tokens", "gpt")
        assert all(Path(p).resolve().is_relative_to(root.resolve()) for ps in info.shard_paths.values() for p in ps)
        steps_per_epoch(info.rows("train"), 2)
    except RaydlError:
        return


DATASET = _dataset_dir()
