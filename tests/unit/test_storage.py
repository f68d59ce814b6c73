"""Locations as (filesystem, path) and back (raydl.storage), and datasets written to and read from a real S3
server (moto on loopback, the `s3_bucket` fixture): never a local directory named after a URI."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.fs as pafs
import pytest

from raydl import storage
from raydl.cli import main
from raydl.data.dataset import open_dataset
from raydl.errors import DataError

boto3 = pytest.importorskip("boto3", reason="the S3 tests need raydl's [test] extra (moto[server], boto3)")

TEXT = "To be, or not to be, that is the question.\n" * 400


@pytest.mark.parametrize("location, fs_type, path, back", [
    ("runs/ckpt", pafs.LocalFileSystem, "runs/ckpt", "runs/ckpt"),
    ("file:///tmp/ckpt", pafs.LocalFileSystem, "/tmp/ckpt", "/tmp/ckpt"),
    ("gs://bucket/ds", pafs.GcsFileSystem, "bucket/ds", "gs://bucket/ds"),
    ("memory://scratch/ds", pafs.PyFileSystem, "/scratch/ds", "memory:///scratch/ds"),   # pyarrow lacks it: fsspec
])
def test_a_location_resolves_to_its_filesystem_and_back_to_the_same_scheme(location, fs_type, path, back):
    fs, resolved = storage.resolve(location, "data.path")
    assert isinstance(fs, fs_type) and resolved == path
    assert storage.uri(fs, resolved) == back
    assert storage.resolve(back, "data.path")[1] == path


def test_s3_resolves_to_pyarrows_s3_and_keeps_its_scheme(s3_bucket):
    fs, path = storage.resolve(f"{s3_bucket}/ds/a", "data.path")
    assert isinstance(fs, pafs.S3FileSystem) and path == f"{s3_bucket.removeprefix('s3://')}/ds/a"
    assert storage.uri(fs, path) == f"{s3_bucket}/ds/a"


def test_gs_keeps_its_scheme_with_anonymous_access():
    """No GCS server here: gs:// goes through pyarrow's GcsFileSystem, the same interface S3 is tested through."""
    fs = pafs.GcsFileSystem(anonymous=True)
    assert storage.uri(fs, "bucket/ckpt/step_00000010") == "gs://bucket/ckpt/step_00000010"
    assert storage.uri(pafs.SubTreeFileSystem("bucket/ckpt", fs), "step_1") == "gs://bucket/ckpt/step_1"
    assert storage.join("gs://bucket/ckpt/", "run", "step_1") == "gs://bucket/ckpt/run/step_1"


def test_an_unknown_scheme_is_one_paragraph_naming_the_field(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "plays.txt"
    src.write_text(TEXT)
    assert main(["data", "prepare", "--from", "text", str(src), "--out", "nosuch://bucket/ds"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydl: error: --out 'nosuch://bucket/ds' has the scheme nosuch://") and "Fix:" in err
    assert err.count("\n") == 1 and sorted(os.listdir(tmp_path)) == ["plays.txt"]


@pytest.mark.slow   # moto's S3 server, a process
def test_prepare_inspect_and_open_on_s3_write_nothing_locally(s3_bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "plays.txt"
    src.write_text(TEXT)
    out = f"{s3_bucket}/datasets/plays"
    assert main(["-q", "data", "prepare", "--from", "text", str(src), "--out", out, "--shard-rows", "16"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["plays.txt"]          # no local directory named s3:
    info = open_dataset(out)
    assert info.root == out and info.rows("train") + info.rows("eval") == info.meta["rows"] > 16
    bucket = s3_bucket.removeprefix("s3://")
    s3 = boto3.client("s3")
    for shard in info.splits["train"] + info.splits["eval"]:   # the sha256 taken while writing is the object's
        body = s3.get_object(Bucket=bucket, Key=f"datasets/plays/{shard.file}")["Body"].read()
        assert hashlib.sha256(body).hexdigest() == shard.sha256
    capsys.readouterr()
    assert main(["data", "inspect", "--verify", "--json", out]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == info.meta["rows"]
    assert main(["data", "prepare", "--from", "text", str(src), "--out", out]) == 2   # never over a dataset
    assert "already exists and is not empty" in capsys.readouterr().err


def test_a_missing_bucket_is_one_paragraph_and_writes_nothing(s3_bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "plays.txt"
    src.write_text(TEXT)
    assert main(["data", "prepare", "--from", "text", str(src), "--out", "s3://no-such-bucket/ds"]) == 2
    err = capsys.readouterr().err
    assert "--out 's3://no-such-bucket/ds' names the bucket 'no-such-bucket', which does not exist" in err
    assert sorted(os.listdir(tmp_path)) == ["plays.txt"]
    with pytest.raises(storage.StorageError, match="data.path .s3://no-such-bucket/ds. names the bucket"):
        open_dataset("s3://no-such-bucket/ds")


@pytest.fixture
def checking_s3(monkeypatch):
    """An S3 server that refuses every request it cannot authenticate, as AWS does (moto's own server accepts
    any key): the endpoint is set, the credentials are the test's to choose."""
    from raydl.bench.procs import free_port
    from tests.s3 import CheckingS3Server

    with CheckingS3Server(free_port()) as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield server


def test_credentials_the_store_refuses_stop_train_before_ray_starts(checking_s3, tmp_path, monkeypatch, capsys):
    from raydl.driver import ray_trainer

    def ray_started(*args, **kwargs):
        raise AssertionError("Ray was started (or joined) before the storage check refused the run")

    monkeypatch.setattr(ray_trainer, "connect", ray_started)   # a session-wide Ray may already be up
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret")
    assert main(["train", "--set", "checkpoint.storage_path=s3://ckpts/runs", "--set",
                 f"data.cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.storage_path 's3://ckpts/runs' cannot be reached" in err and "ACCESS_DENIED" in err
    assert "AWS_ACCESS_KEY_ID" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow   # moto's S3 server, a process
def test_no_credentials_at_all_stop_prepare_with_one_paragraph(checking_s3, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))      # no ~/.aws/credentials either
    src = tmp_path / "plays.txt"
    src.write_text(TEXT)
    assert main(["data", "prepare", "--from", "text", str(src), "--out", "s3://datasets/plays"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydl: error: --out 's3://datasets/plays' cannot be reached") and "credentials" in err
    assert err.count("\n") == 1 and sorted(os.listdir(tmp_path)) == ["plays.txt"]


def _objects(bucket: str, prefix: str) -> list[str]:
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [o["Key"].rsplit("/", 1)[1] for o in listing.get("Contents", [])]


@pytest.mark.slow
def test_a_prepare_killed_halfway_leaves_no_manifest_and_no_dataset(s3_bucket, tmp_path):
    """SIGKILL while shards are uploading: shards without manifest.json, which no reader takes for a dataset."""
    src = tmp_path / "big.txt"
    src.write_text(TEXT * 40)                     # ~700 KB: a few hundred shards of 4 rows
    out, bucket = f"{s3_bucket}/ds", s3_bucket.removeprefix("s3://")
    raydl = os.path.join(os.path.dirname(sys.executable), "raydl")
    proc = subprocess.Popen([raydl, "-q", "data", "prepare", "--from", "text", str(src), "--out", out, "--shard-rows",
                             "4"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_objects(bucket, "ds/")) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.1)   # polling the bucket for the first shards, bounded by the deadline
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    written = _objects(bucket, "ds/")
    assert len(written) >= 5 and "manifest.json" not in written
    with pytest.raises(DataError, match="has no manifest.json, so it is not a raydl dataset"):
        open_dataset(out)
    assert not (tmp_path / "s3:").exists()


def test_the_builtin_dataset_is_generated_once_into_a_bucket_cache(s3_bucket, tmp_path, monkeypatch):
    from raydl.data.dataset import resolve_path
    from raydl.overrides import load_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, [f"data.cache_dir={s3_bucket}/cache", "data.builtin_samples=1024"])
    path = resolve_path(cfg, "tokens")
    assert path.startswith(f"{s3_bucket}/cache/tokens-") and open_dataset(path).rows("train") > 0
    written = _objects(s3_bucket.removeprefix("s3://"), "cache/")
    assert "manifest.json" in written and resolve_path(cfg, "tokens") == path      # the second call reuses it
    assert _objects(s3_bucket.removeprefix("s3://"), "cache/") == written and os.listdir(tmp_path) == []


@pytest.mark.slow   # moto's S3 server, a process
def test_the_loader_reads_the_same_epoch_from_a_bucket_as_from_disk(s3_bucket, tmp_path):
    """Shards downloaded once, checked against their sha256 and decoded from memory: the same rows, same order."""
    from raydl.data.loader import StepLoader
    from raydl.data.order import DataPosition
    from raydl.data.prepare import prepare
    from tests.unit.test_data_loader import make_dataset

    local = make_dataset(tmp_path)
    remote = f"{s3_bucket}/ds"
    prepare("parquet", str(tmp_path / "src.parquet"), remote, shard_rows=512, progress=False)

    def epoch(path: str) -> list[list[int]]:
        loader = StepLoader(open_dataset(path), global_batch=64, dp_rank=0, dp_size=1, seed=0, shuffle=True,
                            position=DataPosition(0, 0), prefetch=2, backend="arrow")
        return [step.tensors["id"].tolist() for _, step in zip(range(loader.steps_per_epoch), loader)]

    steps = epoch(remote)
    assert len(steps) == 32 and steps == epoch(str(local))     # 2048 train rows in steps of 64


def test_a_file_uri_is_the_local_path_it_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "plays.txt"
    src.write_text(TEXT)
    assert main(["-q", "data", "prepare", "--from", "text", str(src), "--out", f"file://{tmp_path}/ds"]) == 0
    assert open_dataset(str(tmp_path / "ds")).meta["task"] == "tokens"
    assert sorted(os.listdir(tmp_path)) == ["ds", "plays.txt"]          # no directory named file:
