"""raydl.worker under torchrun checkpoints to a bucket as Ray Train runs do (storage_path/<run>-<run id>/step_N),
on a real S3 server (moto on loopback): each rank uploads its own shards, rank 0 the two files that make a
checkpoint complete, last; nothing stays in the run directory; a new run resumes from the bucket."""

from __future__ import annotations

import json

import pytest

from tests.helpers import torchrun_worker

boto3 = pytest.importorskip("boto3", reason="the S3 tests need raydl's [test] extra (moto[server], boto3)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHECKPOINT_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "files-rank0.json", "files-rank1.json",
                    "raydl_state.json"]
RECORD_FILES = ["config.yaml", "dataset.json", "metrics.jsonl", "run_id", "summary.json"]


def _checkpoints(bucket: str, prefix: str) -> dict[str, list[str]]:
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    # keys ending in "/" are the directory markers pyarrow writes
    found: dict[str, list[str]] = {}
    for key in (o["Key"].removeprefix(prefix) for o in listing if not o["Key"].endswith("/")):
        run, step, name = key.split("/")
        found.setdefault(f"{run}/{step}", []).append(name)
    return {k: sorted(v) for k, v in found.items()}


def test_torchrun_checkpoints_to_a_bucket_and_resumes_from_it(s3_bucket, tiny_overrides, tmp_path):
    bucket = s3_bucket.removeprefix("s3://")
    sets = [*tiny_overrides, f"checkpoint.storage_path={s3_bucket}/ckpt", "checkpoint.keep=1"]
    first = torchrun_worker(2, tmp_path / "first", sets, timeout_s=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = (tmp_path / "first" / "run_id").read_text().strip()
    summary = json.loads((tmp_path / "first" / "summary.json").read_text())
    assert summary["checkpoint"] == f"{s3_bucket}/ckpt/first-{run_id}/step_00000020"
    # keep=1: step 10 was removed from the bucket once step 20 was complete; nothing stays on local disk; the
    # run's record beside its checkpoints
    assert _checkpoints(bucket, "ckpt/") == {f"first-{run_id}/step_00000020": CHECKPOINT_FILES,
                                             f"first-{run_id}/run": RECORD_FILES}
    assert not list((tmp_path / "first").glob("train/step_*"))
    record = boto3.client("s3").get_object(Bucket=bucket, Key=f"ckpt/first-{run_id}/run/summary.json")["Body"]
    assert json.loads(record.read()) == summary

    more = [s.replace("train.max_steps=20", "train.max_steps=30") for s in sets]
    second = torchrun_worker(2, tmp_path / "second", more, timeout_s=300, resume=tmp_path / "first")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {s3_bucket}/ckpt/first-{run_id}/step_00000020 at step 20" in second.stderr
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["checkpoint"].startswith(f"{s3_bucket}/ckpt/second-")
