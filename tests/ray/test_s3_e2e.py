"""Everything on s3:// against a real S3 server (moto's, on loopback; the `s3_bucket` fixture), as a user of a
cluster without a shared disk runs it: prepare -> train (a worker SIGKILLed mid-run) -> resume from the run
directory past a checkpoint whose upload was cut off -> export to the bucket -> report; and the exactly-once
ledger with the data and the checkpoints in the bucket. Each `raydl` is a subprocess with its own local Ray,
which inherits the AWS_* env of the fixture; stdout must be the summary JSON alone (`-q`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raydl.bench.fault_cluster import train_workers
from raydl.bench.procs import kill
from tests.helpers import not_raydls
from raydl.data.prepare import prepare
from raydl.data.ledger_read import committed_ids, epoch_ids
from tests.unit.test_data_loader import make_dataset
from tests.unit.test_data_prepare import write_texts

boto3 = pytest.importorskip("boto3", reason="the S3 tests need raydl's [test] extra (moto[server], boto3)")

pytestmark = pytest.mark.slow
RAYDL = str(Path(sys.executable).parent / "raydl")
# Long enough that the worker SIGKILLed after step 30 dies well before the run's end (70 steps of ~0.1 s and 7
# checkpoint uploads later); it was 200 (91 s for the file's first test on a quiet 2-core machine).
STEPS = 100


def raydl(cwd: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([RAYDL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def sets(*kv: str) -> list[str]:
    return [a for s in kv for a in ("--set", s)]


def objects(uri: str) -> list[str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def newest_step(runs: Path) -> int:
    records = [json.loads(line) for f in runs.glob("*/metrics.jsonl") for line in f.read_text().splitlines()]
    return max((r["step"] for r in records), default=0)


def test_prepare_train_kill_resume_export_report_all_on_s3(s3_bucket, tmp_path):
    data, ckpts, runs = f"{s3_bucket}/data/plays", f"{s3_bucket}/ckpt", tmp_path / "runs"
    p = raydl(tmp_path, "-q", "data", "prepare", "--from", "text", str(write_texts(tmp_path / "txt")), "--out", data,
              "--seq-len", "32", "--shard-rows", "256")
    assert p.returncode == 0, p.stderr
    common = ["model.name=gpt", f"data.path={data}", f"checkpoint.storage_path={ckpts}", f"run.runs_dir={runs}",
              "train.global_batch_size=16", "train.micro_batch_size=8", "train.eval_batches=1",
              "checkpoint.every_steps=10", "telemetry.report_every=10", "telemetry.progress=false",
              "scaling.survivors=off"]   # the kill restarts the group, which resumes from the bucket

    train = subprocess.Popen([RAYDL, "-q", "train", *sets(*common, f"train.max_steps={STEPS}")], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while newest_step(runs) < 30 or not any("step_00000020/" in k for k in objects(ckpts)):
        assert train.poll() is None and time.monotonic() < deadline, train.communicate()[1][-4000:]
        time.sleep(0.5)   # polling the run's metrics and the bucket, bounded by the deadline
    assert kill(train_workers(train.pid)[-1])
    out, err = train.communicate(timeout=600)
    assert train.returncode == 0, err[-4000:]
    summary = json.loads(out)                      # stdout is the summary alone, worker death or not
    assert summary["steps"] == STEPS and len(summary["restarts"]) >= 1, summary["restarts"]
    assert summary["checkpoint"].startswith("s3://") and summary["checkpoint"].endswith(f"step_{STEPS:08d}"), summary
    run_dir = Path(summary["run_dir"])
    assert not not_raydls(err), "\n".join(not_raydls(err))   # Ray's lines about the death: in ray.log
    assert "A worker died or was killed" in (run_dir / "ray.log").read_text()
    name = f"{run_dir.name}-{(run_dir / 'run_id').read_text().strip()}"
    keys = objects(f"{ckpts}/{name}/")
    assert any(k.endswith(f"step_{STEPS:08d}/raydl_state.json") for k in keys), keys
    assert not list(tmp_path.rglob("s3:")) and not (run_dir / "train").exists()   # nothing of it on local disk
    p = raydl(tmp_path, "report", f"{ckpts}/{name}/run")     # the run's record beside its checkpoints
    assert p.returncode == 0 and str(STEPS) in p.stdout, p.stderr[-4000:]

    # The newest checkpoint's upload cut off: its state and .metadata are there, one rank's shard is not.
    bucket = s3_bucket.removeprefix("s3://")
    shard = next(k for k in keys if f"step_{STEPS:08d}/__1_" in k)
    boto3.client("s3").delete_object(Bucket=bucket, Key=shard)
    # only what changes: the run's config.yaml (its model, bucket dataset and checkpoint storage) is the base
    p = raydl(tmp_path, "-q", "train", "--resume", str(run_dir), *sets(f"train.max_steps={STEPS + 20}"))
    assert p.returncode == 0, p.stderr[-4000:]
    resumed = json.loads(p.stdout)
    assert f"step_{STEPS:08d} is not usable" in p.stderr and "falling back to" in p.stderr, p.stderr[-4000:]
    assert resumed["steps"] == STEPS + 20
    first = json.loads((Path(resumed["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])
    assert STEPS - 10 < first["step"] <= STEPS     # trained on from step STEPS - 10, the newest intact checkpoint

    model = f"{s3_bucket}/export/model"
    p = raydl(tmp_path, "export", resumed["run_dir"], "--format", "pt2", "--out", model)
    assert p.returncode == 0, p.stderr[-4000:]
    assert [k.rsplit("/", 1)[1] for k in objects(model)] == ["model.pt2"]
    p = raydl(tmp_path, "export", resumed["run_dir"], "--format", "pt2", "--out", model)
    assert p.returncode == 2 and "already exists" in p.stderr            # never over what is there
    p = raydl(tmp_path, "report", resumed["run_dir"])
    assert p.returncode == 0 and str(STEPS + 20) in p.stdout, p.stderr[-4000:]
    assert not list(tmp_path.rglob("s3:"))


def test_exactly_once_with_data_and_checkpoints_in_the_bucket(s3_bucket, tmp_path):
    """The ledger of tests/ray/test_data_ledger.py, Ray Data reading the shards from the bucket."""
    local = make_dataset(tmp_path)                 # the same rows, prepared again straight into the bucket
    data = f"{s3_bucket}/ds"
    prepare("parquet", str(tmp_path / "src.parquet"), data, shard_rows=512, progress=False)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    p = raydl(tmp_path, "-q", "train", *sets(
        # Half a CPU per worker leaves this 2-CPU local Ray one for Ray Data's read tasks.
        f"data.path={data}", "data.backend=ray", "scaling.cpus_per_worker=0.5", f"checkpoint.storage_path={s3_bucket}/ckpt",
        f"run.runs_dir={tmp_path / 'runs'}", "scaling.max_failures=1", "train.max_steps=32",
        "train.global_batch_size=64", "train.micro_batch_size=32", "train.eval_batches=1", "checkpoint.every_steps=5",
        "telemetry.report_every=5", "telemetry.progress=false", f"debug.ledger_dir={ledger}", "debug.fail_at_step=13",
        "checkpoint.memory_every_steps=0",   # the restart reads the checkpoint from the bucket, not the state holder
        "scaling.survivors=off"))
    assert p.returncode == 0, p.stderr[-4000:]
    [restart] = json.loads(p.stdout)["restarts"]
    # From a checkpoint in the bucket: step 10's, or step 5's where Train's controller had not yet registered step 10's
    # report when the failure came (it registers a report at its next poll; seen once, 2026-11-28: steps 6-10 redone).
    assert "injected failure at step 13" in restart["cause"] and restart["resumed_at_step"] in (5, 10), restart
    ids = [i for step_ids in committed_ids(ledger).values() for i in step_ids]
    assert len(ids) == len(set(ids)) and sorted(ids) == epoch_ids(local)
