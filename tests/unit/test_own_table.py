"""A user's own parquet table (issue 12 item 6): prepared with every column kept, read back through the
real loader (variable-length lists padded per batch with a mask, every row exactly once), and a spec
that reads a column the table lacks or cannot give as a tensor refused before Ray starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydl.cli import main
from raydl.data.columns import numpy_name
from raydl.data.dataset import check_columns, open_dataset
from raydl.data.loader import StepLoader
from raydl.data.order import DataPosition

REPO = Path(__file__).resolve().parents[2]
ROWS, FEATURES, GB = 600, 3, 32


def write_table(path: Path, rows: int = ROWS) -> pa.Table:
    """An int scalar, a float scalar, a fixed-size float list, a variable-length int list (some rows
    empty), a string and a struct: the kinds a table from elsewhere holds."""
    rng = np.random.default_rng(7)
    features = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    table = pa.table({
        "count": pa.array(rng.integers(0, 1000, rows), pa.int32()),
        "score": pa.array(rng.standard_normal(rows)),
        "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), FEATURES),
        "tags": pa.array([rng.integers(1, 50, rng.integers(0, 9)).tolist() for _ in range(rows)],
                         pa.list_(pa.int64())),
        "name": pa.array([f"r{i}" for i in range(rows)]),
        "where": pa.array([{"x": i, "y": -i} for i in range(rows)]),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return table


def prepare_argv(src: Path, out: Path, *extra: str) -> list[str]:
    return ["data", "prepare", "--from", "parquet", str(src), "--out", str(out), "--quiet", *extra]


@pytest.fixture
def table_dataset(tmp_path) -> tuple[pa.Table, Path]:
    source = write_table(tmp_path / "raw" / "t.parquet")
    assert main(prepare_argv(tmp_path / "raw" / "t.parquet", tmp_path / "ds", "--shard-rows", "200")) == 0
    return source, tmp_path / "ds"


def test_any_table_keeps_its_columns_and_describes_the_numeric_ones(table_dataset):
    _, ds = table_dataset
    manifest = json.loads((ds / "manifest.json").read_text())
    assert manifest["task"] == "table"
    assert set(manifest["schema"]) == {"id", "count", "score", "features", "tags", "name", "where"}
    assert manifest["columns"] == {"count": {"dtype": "int32", "shape": []},
                                   "score": {"dtype": "float64", "shape": []},
                                   "features": {"dtype": "float32", "shape": [FEATURES]},
                                   "tags": {"dtype": "int64", "shape": [-1]}}


NUMBER_TYPES = [pa.bool_(), pa.float16(), pa.float32(), pa.float64(),
                *(getattr(pa, f"{sign}int{bits}")() for sign in ("", "u") for bits in (8, 16, 32, 64))]


@pytest.mark.parametrize("kind", NUMBER_TYPES, ids=str)
def test_a_number_column_is_described_by_its_numpy_dtype(kind):
    """numpy_name, not pyarrow's to_pandas_dtype: the same names without importing pandas (0.3 s a process)."""
    assert np.dtype(numpy_name(kind)) == np.dtype(kind.to_pandas_dtype())
    assert pa.from_numpy_dtype(np.dtype(numpy_name(kind))) == kind


def test_loader_pads_each_batch_to_its_longest_row_and_serves_every_row_once(table_dataset):
    source, ds = table_dataset
    info = open_dataset(str(ds))
    seen, widths = [], set()
    for rank in range(2):
        loader = StepLoader(info, global_batch=GB, dp_rank=rank, dp_size=2, seed=3, shuffle=True,
                            position=DataPosition(), prefetch=0)
        for _, batch in zip(range(loader.steps_per_epoch), loader):
            seen.extend(_check_batch(source, batch.tensors))
            widths.add(batch.tensors["tags"].shape[1])
    train_rows = info.rows("train")
    assert len(seen) == len(set(seen)) == train_rows - train_rows % GB
    assert len(widths) > 1     # padded per batch, not to the table's longest row


def _check_batch(source: pa.Table, tensors: dict) -> list[int]:
    """Every tensor of the batch equals its source rows (raydl's id is the row's index in the input)."""
    ids = tensors["id"].tolist()
    rows = source.take(pa.array(ids)).to_pydict()
    assert "name" not in tensors and "where" not in tensors     # no model can read them as tensors
    assert tensors["count"].tolist() == rows["count"] and tensors["score"].tolist() == rows["score"]
    assert np.allclose(tensors["features"].numpy(), np.array(rows["features"], dtype=np.float32))
    lengths = [len(t) for t in rows["tags"]]
    assert tensors["tags"].shape == (len(ids), max(lengths)) and tensors["tags_mask"].dtype == torch.bool
    assert tensors["tags_mask"].sum(1).tolist() == lengths
    for values, mask, tags in zip(tensors["tags"].tolist(), tensors["tags_mask"].tolist(), rows["tags"]):
        assert values == tags + [0] * (len(values) - len(tags)) and mask == [i < len(tags) for i in range(len(mask))]
    return ids


def test_a_spec_may_read_a_variable_list_and_its_mask(table_dataset):
    check_columns(open_dataset(str(table_dataset[1])), ("tags", "tags_mask", "count"), "probe")


@pytest.fixture
def probe_models(tmp_path, monkeypatch):
    """tablemodels/reg.py: the example regressor, and variants of it reading columns it cannot have."""
    (tmp_path / "tablemodels").mkdir()
    (tmp_path / "tablemodels" / "reg.py").write_text(
        (REPO / "examples" / "mlp_regressor.py").read_text()
        + "\nimport dataclasses\n\n"
        + "missing = dataclasses.replace(spec, columns=('features', 'weight'))\n"
        + "strings = dataclasses.replace(spec, columns=('features', 'name'))\n"
        + "structs = dataclasses.replace(spec, columns=('where',))\n"
        + "fixed_mask = dataclasses.replace(spec, columns=('features_mask',))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("tablemodels.reg", None)
    sys.modules.pop("tablemodels", None)


@pytest.mark.parametrize("attribute, says", [
    ("missing", "has no column 'weight', which model 'mlp_regressor' reads"),
    ("strings", "column 'name' is string, which model 'mlp_regressor' reads (ModelSpec.columns) but no model can take"),
    ("structs", "column 'where' is struct<x: int64, y: int64>"),
    ("fixed_mask", "has no column 'features_mask'"),    # only variable-length lists have a mask
])
def test_a_column_the_spec_cannot_have_exits_2_naming_it_before_ray_starts(probe_models, capsys, attribute, says):
    raw = probe_models / "t.parquet"
    write_table(raw, rows=64)
    assert main(prepare_argv(raw, probe_models / "ds")) == 0
    capsys.readouterr()
    argv = ["train", "--set", f"model.name=tablemodels.reg:{attribute}", "--set", f"data.path={probe_models / 'ds'}",
            "--set", f"run.runs_dir={probe_models / 'runs'}"]
    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydl: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    assert says in err and "Fix:" in err, err
    assert not (probe_models / "runs").exists()
    assert ray_was_up == ("ray" in sys.modules and sys.modules["ray"].is_initialized())


@pytest.mark.parametrize("table, says", [
    (pa.table({"name": ["a", "b"], "where": [{"x": 1}, {"x": 2}]}), "none of them numbers"),
    (pa.table({"tags": pa.array([[1], [2, 3]]), "tags_mask": [1, 2]}), "already has a column of that name"),
])
def test_a_table_no_model_can_read_exits_2_and_writes_nothing(tmp_path, capsys, table, says):
    pq.write_table(table, tmp_path / "t.parquet")
    assert main(prepare_argv(tmp_path / "t.parquet", tmp_path / "ds")) == 2
    err = capsys.readouterr().err
    assert says in err and "Fix:" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


def test_a_table_may_name_its_columns_as_raydl_tasks_do(tmp_path):
    """label and input_ids of a generic table are whatever the user stored: strings, floats, scalars."""
    table = pa.table({"label": ["cat", "dog"] * 20, "input_ids": np.arange(40.0), "x": np.arange(40)})
    pq.write_table(table, tmp_path / "t.parquet")
    assert main(prepare_argv(tmp_path / "t.parquet", tmp_path / "ds", "--keep-columns")) == 0
    columns = json.loads((tmp_path / "ds" / "manifest.json").read_text())["columns"]
    assert set(columns) == {"input_ids", "x"}


def test_keep_columns_keeps_a_text_table_as_a_table(tmp_path):
    pq.write_table(pa.table({"text": ["hello world"] * 40, "y": np.arange(40.0)}), tmp_path / "t.parquet")
    assert main(prepare_argv(tmp_path / "t.parquet", tmp_path / "ds", "--keep-columns")) == 0
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["task"] == "table" and set(manifest["schema"]) == {"id", "text", "y"}


def test_a_skipped_shard_of_a_table_gives_masked_placeholder_rows(table_dataset):
    _, ds = table_dataset
    shard = ds / "train-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:-100] + b"\0" * 100)      # fails its sha256
    info = open_dataset(str(ds))
    loader = StepLoader(info, global_batch=GB, dp_rank=0, dp_size=1, seed=3, shuffle=False,
                        position=DataPosition(), prefetch=0, max_bad_shards=1)
    batch = next(iter(loader)).tensors
    placeholder = batch["id"] == -1
    assert placeholder.all() and not batch["tags_mask"].any()     # the first window is the bad shard's
