"""Exactly once per epoch, across a worker failure and a resize: a ledger of consumed sample ids.

Twice: under torchrun (gloo, data.backend=arrow) and through `raydl train` on the session's Ray
cluster with data.backend=ray, where Ray Train's FailureConfig restarts the worker group and Ray
Data streams the rows. Real parquet, real DCP checkpoints. The loader writes the
ids each rank hands to training (debug.ledger_dir, see raydl/data/ledger.py); a step counts as
consumed if it is at or before the checkpoint the next attempt resumed from (later steps were
lost with the failed attempt and are redone). The union must be the epoch exactly, no duplicates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raydl.overrides import load_config
from raydl.driver.ray_trainer import run_training
from tests.unit.test_data_loader import make_dataset

pytestmark = pytest.mark.slow
GB, STEPS = 64, 32          # 2048 train rows = one epoch of 32 steps


def torchrun(nproc: int, run_dir: Path, data: Path, ledger: Path, *overrides: str,
             fail_at: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fail = [f"debug.fail_at_step={fail_at}"] if fail_at is not None else []
    sets = [f"data.path={data}", f"train.global_batch_size={GB}", "train.micro_batch_size=32", "train.eval_batches=1",
            "checkpoint.every_steps=5", "telemetry.report_every=5", "telemetry.progress=false",
            f"debug.ledger_dir={ledger}", *fail, *overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "raydl.worker", "--run-dir", str(run_dir),
           *(a for s in sets for a in ("--set", s))]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def committed_ids(ledger: Path) -> list[int]:
    """Ids of the steps that count: each attempt's steps up to where the next attempt started.

    Attempts are told apart by their start position (each test's attempts start at distinct
    checkpoints, which `attempt_starts` asserts)."""
    files = [[json.loads(x) for x in f.read_text().splitlines()] for f in ledger.glob("ledger-*.jsonl")]
    starts = sorted({(lines[0]["start"]["epoch"], lines[0]["start"]["offset"]) for lines in files})
    ids = []
    for header, *records in files:
        start = (header["start"]["epoch"], header["start"]["offset"])
        limit = starts[starts.index(start) + 1] if start != starts[-1] else (10**9, 0)
        ids += [i for r in records if (r["epoch"], r["offset"]) <= limit for i in r["ids"]]
    return ids


def epoch_ids(data: Path) -> list[int]:
    return sorted(i for f in data.glob("train-*.parquet") for i in pq.read_table(f)["id"].to_pylist())


def attempt_starts(ledger: Path) -> list[int]:
    return sorted({json.loads(f.read_text().splitlines()[0])["start"]["offset"] for f in ledger.glob("ledger-*")})


def test_worker_failure_mid_epoch_is_exactly_once(tmp_path):
    data, ledger = make_dataset(tmp_path), tmp_path / "ledger"
    ledger.mkdir()
    failed = torchrun(2, tmp_path / "run", data, ledger, f"train.max_steps={STEPS}", fail_at=13)
    assert failed.returncode != 0 and "injected failure at step 13" in failed.stderr, failed.stderr[-3000:]
    # The restart: a new worker group on the same run directory, as Ray's FailureConfig or torchrun's
    # --max-restarts would start it (torchrun's own in-place restart cannot re-form a gloo group here).
    p = torchrun(2, tmp_path / "run", data, ledger, f"train.max_steps={STEPS}", fail_at=13)
    assert p.returncode == 0, p.stderr[-3000:]
    assert attempt_starts(ledger) == [0, 10 * GB]              # restarted from the step-10 checkpoint
    ids = committed_ids(ledger)
    assert len(ids) == len(set(ids)) and sorted(ids) == epoch_ids(data)


def test_resume_mid_epoch_with_fewer_workers_is_exactly_once(tmp_path):
    data, ledger = make_dataset(tmp_path), tmp_path / "ledger"
    ledger.mkdir()
    first = torchrun(2, tmp_path / "run", data, ledger, "train.max_steps=15")
    assert first.returncode == 0, first.stderr[-3000:]
    second = torchrun(1, tmp_path / "run", data, ledger, f"train.max_steps={STEPS}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and attempt_starts(ledger) == [0, 15 * GB]
    dp_sizes = {json.loads(f.read_text().splitlines()[0])["dp_size"] for f in ledger.glob("ledger-*")}
    assert dp_sizes == {1, 2}
    ids = committed_ids(ledger)
    assert len(ids) == len(set(ids)) and sorted(ids) == epoch_ids(data)


def raydl_train(data: Path, run_dir: Path, workers: int, steps: int, *debug: str, resume: str | None = None) -> dict:
    sets = [f"data.path={data}", "data.backend=ray", f"run.dir={run_dir}", f"scaling.min_workers={workers}",
            f"scaling.max_workers={workers}", "scaling.max_failures=1", f"train.max_steps={steps}",
            f"train.global_batch_size={GB}", "train.micro_batch_size=32", "train.eval_batches=1",
            "checkpoint.every_steps=5", "telemetry.report_every=5", "telemetry.progress=false", *debug]
    return run_training(load_config(None, sets), resume=resume)


def test_ray_data_worker_failure_and_resize_are_exactly_once(ray_session, tmp_path):
    data = make_dataset(tmp_path)
    failure, resize = tmp_path / "ledger-failure", tmp_path / "ledger-resize"
    failure.mkdir(), resize.mkdir()

    # The debug section travels to the Ray workers inside the job's config, like every other field.
    summary = raydl_train(data, tmp_path / "run-failure", 2, STEPS, f"debug.ledger_dir={failure}",
                          "debug.fail_at_step=13")
    [restart] = summary["restarts"]
    assert "injected failure at step 13" in restart["cause"] and restart["resumed_at_step"] == 10, restart
    assert summary["steps"] == STEPS
    assert attempt_starts(failure) == [0, 10 * GB]           # Ray restarted the group from the step-10 checkpoint
    ids = committed_ids(failure)
    assert len(ids) == len(set(ids)) and sorted(ids) == epoch_ids(data)

    first = raydl_train(data, tmp_path / "run-resize", 2, 15, f"debug.ledger_dir={resize}")
    second = raydl_train(data, tmp_path / "run-resize-1", 1, STEPS, f"debug.ledger_dir={resize}",
                         resume=first["run_dir"])
    assert second["world_sizes"] == [1] and attempt_starts(resize) == [0, 15 * GB]
    ids = committed_ids(resize)
    assert len(ids) == len(set(ids)) and sorted(ids) == epoch_ids(data)
