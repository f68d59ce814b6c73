"""Everything on s3:// against a real S3 server (moto's, on loopback; the `s3_bucket` fixture), as a user of a
cluster without a shared disk runs it, in one run: prepare -> train with Ray Data reading the shards from the bucket
(a failure injected, then a worker SIGKILLed mid-run, each restart from a checkpoint in the bucket; every sample taken
exactly once, the ledger of tests/ray/test_data_ledger.py) -> resume from the run directory past a checkpoint whose
upload was cut off -> export to the bucket -> report. Each `raydl` is a subprocess; each `raydl train` starts its own
local Ray, which inherits the AWS_* env of the fixture; stdout must be the summary JSON alone (`-q`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.bench.fault_cluster import poll, train_workers
from raydl.bench.procs import kill
from tests.helpers import not_raydls
from raydl.data.ledger_read import committed_ids, epoch_ids
from tests.unit.test_data_loader import make_dataset

boto3 = pytest.importorskip("boto3", reason="the S3 tests need raydl's [test] extra (moto[server], boto3)")

pytestmark = pytest.mark.slow
RAYDL = str(Path(sys.executable).parent / "raydl")
# One epoch of make_dataset's 2,048 rows at 64 a step, so that the ledger holds one whole epoch. The run holds after
# step KILL_AT (debug.hold_at_step, its checkpoint uploaded) until a worker is SIGKILLed there, so the death comes
# mid-run however slow the machine. Until 2026-11-29 the exactly-once run was a test of its own (54.9 CPU-s: its own
# local Ray and run) and the kill came after step 30 of 100 (112.6 CPU-s).
STEPS = 32
FAIL_AT = 13
KILL_AT = 25


def raydl(cwd: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([RAYDL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def sets(*kv: str) -> list[str]:
    return [a for s in kv for a in ("--set", s)]


def objects(uri: str) -> list[str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def both_ranks_held(ledger: Path, train: subprocess.Popen) -> bool:
    """Both workers wait at debug.hold_at_step (raydl/train/hold.py), or the run ended early."""
    return train.poll() is not None or len(list(ledger.glob("held-*"))) >= 2


def test_prepare_train_fail_kill_resume_export_report_all_on_s3_exactly_once(s3_bucket, tmp_path):
    local = make_dataset(tmp_path)                 # the rows the ledger is checked against
    data, ckpts, runs, ledger = f"{s3_bucket}/data/ds", f"{s3_bucket}/ckpt", tmp_path / "runs", tmp_path / "ledger"
    p = raydl(tmp_path, "-q", "data", "prepare", "--from", "parquet", str(tmp_path / "src.parquet"), "--out", data,
              "--shard-rows", "512")           # the same rows, prepared again straight into the bucket
    assert p.returncode == 0, p.stderr
    common = [f"data.path={data}", "data.backend=ray", f"checkpoint.storage_path={ckpts}", f"run.runs_dir={runs}",
              "scaling.cpus_per_worker=0.5",   # half a CPU per worker leaves this 2-CPU local Ray one for Ray Data
              "train.global_batch_size=64", "train.micro_batch_size=32", "train.eval_batches=1",
              "checkpoint.every_steps=5", "telemetry.report_every=5", "telemetry.progress=false",
              "checkpoint.memory_every_steps=0",   # restarts read the checkpoint from the bucket, not the state holder
              "scaling.survivors=off",   # a failure restarts the group, which resumes from the bucket
              f"debug.ledger_dir={ledger}"]

    first_run = sets(*common, f"train.max_steps={STEPS}", f"debug.fail_at_step={FAIL_AT}",
                     f"debug.hold_at_step={KILL_AT}")
    train = subprocess.Popen([RAYDL, "-q", "train", *first_run], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    poll(f"both workers held at step {KILL_AT}", lambda: both_ranks_held(ledger, train), 300)
    assert train.poll() is None, train.communicate()[1][-4000:]
    assert any(f"step_{KILL_AT:08d}/" in k for k in objects(ckpts))   # the held step's checkpoint is in the bucket
    assert kill(train_workers(train.pid)[-1])
    (ledger / "release").touch()   # the new group trains on: it resumes past the held step, or meets it released
    out, err = train.communicate(timeout=600)
    assert train.returncode == 0, err[-4000:]
    summary = json.loads(out)                      # stdout is the summary alone, worker death or not
    injected, *after_the_kill = summary["restarts"]
    assert after_the_kill, summary["restarts"]
    # From a checkpoint in the bucket: step 10's, or step 5's where Train's controller had not yet registered step 10's
    # report when the failure came (it registers a report at its next poll; seen once, 2026-11-28: steps 6-10 redone).
    assert f"injected failure at step {FAIL_AT}" in injected["cause"] and injected["resumed_at_step"] in (5, 10), \
        injected
    ids = [i for step_ids in committed_ids(ledger).values() for i in step_ids]
    assert len(ids) == len(set(ids)) and sorted(ids) == epoch_ids(local)
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
    assert STEPS - 10 < first["step"] <= STEPS     # trained on from the newest intact checkpoint, step 30's

    model = f"{s3_bucket}/export/model"
    p = raydl(tmp_path, "export", resumed["run_dir"], "--format", "pt2", "--out", model)
    assert p.returncode == 0, p.stderr[-4000:]
    assert [k.rsplit("/", 1)[1] for k in objects(model)] == ["model.pt2"]
    p = raydl(tmp_path, "export", resumed["run_dir"], "--format", "pt2", "--out", model)
    assert p.returncode == 2 and "already exists" in p.stderr            # never over what is there
    p = raydl(tmp_path, "report", resumed["run_dir"])
    assert p.returncode == 0 and str(STEPS + 20) in p.stdout, p.stderr[-4000:]
    assert not list(tmp_path.rglob("s3:"))

