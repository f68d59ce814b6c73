"""A sweep whose base config checkpoints to a bucket keeps its whole directory there (raydl.tune.mirror): trials'
attempts and checkpoints, Tune's experiment, the report. With the driver's local sweep directory deleted (its node
gone), `raydl sweep --resume s3://...` rebuilds it from the bucket and finds every trial finished."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

boto3 = pytest.importorskip("boto3", reason="the S3 tests need raydl's [test] extra (moto[server], boto3)")
pytestmark = pytest.mark.slow
RAYDL = str(Path(sys.executable).parent / "raydl")


def _keys(bucket: str, prefix: str) -> list[str]:
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"].removeprefix(prefix) for page in pages for o in page.get("Contents", [])]


def _sweep(cwd: Path, *args: str) -> None:
    p = subprocess.run([RAYDL, "-q", "sweep", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]


def test_a_sweep_kept_in_a_bucket_resumes_from_it_without_its_local_directory(s3_bucket, data_cache, tmp_path):
    runs = tmp_path / "runs"
    sweep = {"base": {"run": {"runs_dir": str(runs)}, "data": {"cache_dir": str(data_cache), "builtin_samples": 4096},
                      "scaling": {"min_workers": 1, "max_workers": 1},
                      "train": {"warmup_steps": 2, "eval_batches": 2, "global_batch_size": 32},
                      "telemetry": {"report_every": 5, "progress": False},
                      "checkpoint": {"every_steps": 10, "storage_path": f"{s3_bucket}/sweeps"}},
             "space": {"train.max_steps": [10, 20]}, "objective": "eval_loss", "max_concurrent_trials": 1}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    _sweep(tmp_path, "--config", str(tmp_path / "sweep.yaml"))
    sweep_dir = next(runs.iterdir())
    first = json.loads((sweep_dir / "results.json").read_text())
    assert [t["status"] for t in first["trials"]] == ["ok", "ok"]

    bucket, prefix = s3_bucket.removeprefix("s3://"), f"sweeps/{sweep_dir.name}/"
    keys = _keys(bucket, prefix)
    for name in ("sweep.yaml", "trial_starts.jsonl", "completed_trials.txt", "results.json", "best.yaml"):
        assert name in keys
    assert any(k.startswith("tune/") for k in keys)
    for trial in first["trials"]:
        attempt = f"trials/{trial['trial']}/attempt-1/"
        assert {f"{attempt}metrics.jsonl", f"{attempt}summary.json", f"{attempt}config.yaml"} <= set(keys)
        saved = [k for k in keys if k.startswith(f"checkpoints/{trial['trial']}/attempt-1-")]
        assert any(k.endswith(f"step_{trial['steps']:08d}/raydl_state.json") for k in saved)

    shutil.rmtree(runs)           # the driver's node, and its disk, are gone
    _sweep(tmp_path, "--resume", f"{s3_bucket}/sweeps/{sweep_dir.name}")
    again = json.loads((sweep_dir / "results.json").read_text())
    assert [(t["trial"], t["status"], t["steps"], t["attempts"]) for t in again["trials"]] == \
        [(t["trial"], t["status"], t["steps"], t["attempts"]) for t in first["trials"]]
    for trial in again["trials"]:   # the report's records came back from the bucket
        assert (sweep_dir / "trials" / trial["trial"] / "attempt-1" / "metrics.jsonl").is_file()
