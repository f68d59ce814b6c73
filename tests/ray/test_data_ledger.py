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
import subprocess
from pathlib import Path

import pytest

from raydl.overrides import load_config
from raydl.driver.ray_trainer import run_training
from raydl.data.ledger_read import attempts, committed_ids, epoch_ids
from tests.docs_run import blocks_tested_by, checkout_like, run_blocks
from tests.helpers import torchrun_worker
from tests.unit.test_data_loader import make_dataset

pytestmark = pytest.mark.slow
GB, STEPS = 64, 32          # 2048 train rows = one epoch of 32 steps
TEST = "tests/ray/test_data_ledger.py::test_ray_data_worker_failure_and_resize_are_exactly_once"


def torchrun(nproc: int, run_dir: Path, data: Path, ledger: Path, *overrides: str, fail_at: int | None = None,
             resume: Path | None = None) -> subprocess.CompletedProcess:
    fail = [f"debug.fail_at_step={fail_at}"] if fail_at is not None else []
    sets = [f"data.path={data}", f"train.global_batch_size={GB}", "train.micro_batch_size=32", "train.eval_batches=1",
            "checkpoint.every_steps=5", "telemetry.report_every=5", "telemetry.progress=false",
            f"debug.ledger_dir={ledger}", *fail, *overrides]
    return torchrun_worker(nproc, run_dir, sets, timeout_s=240, resume=resume)


def committed(ledger: Path) -> list[int]:
    """The ids of the steps that count, whatever their epoch (these runs train one epoch)."""
    return [i for ids in committed_ids(ledger).values() for i in ids]


def start_offsets(ledger: Path) -> list[int]:
    """Where each attempt started in the epoch, in time order."""
    return [attempt.start["offset"] for attempt in attempts(ledger)]


def test_worker_failure_then_a_resume_with_fewer_workers_mid_epoch_is_exactly_once(tmp_path):
    """A worker fails at step 13 and a new group restarts from the step-10 checkpoint; the run's step-15 checkpoint
    then resumes at one worker to the end of the epoch. One ledger for the three attempts."""
    data, ledger = make_dataset(tmp_path), tmp_path / "ledger"
    ledger.mkdir()
    failed = torchrun(2, tmp_path / "run", data, ledger, "train.max_steps=15", fail_at=13)
    assert failed.returncode != 0 and "injected failure at step 13" in failed.stderr, failed.stderr[-3000:]
    # The restart: a new worker group on the same run directory, as Ray's FailureConfig or torchrun's
    # --max-restarts would start it (torchrun's own in-place restart cannot re-form a gloo group here).
    p = torchrun(2, tmp_path / "run", data, ledger, "train.max_steps=15", fail_at=13)
    assert p.returncode == 0, p.stderr[-3000:]
    assert start_offsets(ledger) == [0, 10 * GB]              # restarted from the step-10 checkpoint
    ids = committed(ledger)
    assert len(ids) == len(set(ids)) == 15 * GB

    second = torchrun(1, tmp_path / "run-1", data, ledger, f"train.max_steps={STEPS}", resume=tmp_path / "run")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and start_offsets(ledger) == [0, 10 * GB, 15 * GB]
    dp_sizes = {attempt.dp_size for attempt in attempts(ledger)}
    assert dp_sizes == {1, 2}
    ids = committed(ledger)
    assert len(ids) == len(set(ids)) and sorted(ids) == epoch_ids(data)


def raydl_train(data: Path, run_dir: Path, workers: int, steps: int, *debug: str, resume: str | None = None) -> dict:
    sets = [f"data.path={data}", "data.backend=ray", f"run.dir={run_dir}", f"scaling.min_workers={workers}",
            f"scaling.max_workers={workers}", "scaling.max_failures=1", f"train.max_steps={steps}",
            f"train.global_batch_size={GB}", "train.micro_batch_size=32", "train.eval_batches=1",
            "checkpoint.every_steps=5", "telemetry.report_every=5", "telemetry.progress=false", *debug]
    return run_training(load_config(None, sets), resume=resume)


def test_ray_data_worker_failure_and_resize_are_exactly_once(ray_session, shared_ray_address, data_cache, tmp_path):
    """As above through `raydl train` with Ray Data: docs/elastic.md's first block (which marks it `tested by` this
    test) as printed there, on this test's dataset with Ray Data: Ray's FailureConfig restarts the group after the
    failure at step 15 from the step-10 checkpoint, and the page's own check of summary.json passes. Then the
    run's last checkpoint (step 30) resumes at one worker to the end of the epoch."""
    data = make_dataset(tmp_path)
    (tmp_path / "page").mkdir()
    cwd = checkout_like(tmp_path / "page", data_cache)
    # The page's settings are the test's (2 workers, the batch of 64 in micro-batches of 32, checkpoints every 10,
    # restarts from storage); the debug section travels to the Ray workers inside the job's config.
    ours = [f"data.path={data}", "data.backend=ray", "train.eval_batches=1"]
    run_blocks(blocks_tested_by("docs/elastic.md", TEST), cwd, shared_ray_address, extra_sets=ours)
    summary = json.loads((cwd / "runs" / "faulty" / "summary.json").read_text())
    ledger = cwd / "ledger"
    [restart] = summary["restarts"]
    assert "injected failure at step 15" in restart["cause"] and restart["resumed_at_step"] == 10, restart
    assert summary["steps"] == 30
    assert start_offsets(ledger) == [0, 10 * GB]           # Ray restarted the group from the step-10 checkpoint
    ids = committed(ledger)
    assert len(ids) == len(set(ids)) == 30 * GB

    # A finished run resumed with more steps (it ended at 30): it goes on at the next step of the same run.
    second = raydl_train(data, tmp_path / "run-1", 1, STEPS, f"debug.ledger_dir={ledger}", resume=summary["run_dir"])
    assert second["world_sizes"] == [1] and start_offsets(ledger) == [0, 10 * GB, 30 * GB]
    assert json.loads((Path(second["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])["step"] == 31
    assert second["steps"] == STEPS and second["restarts"] == [], second["restarts"]
    ids = committed(ledger)
    assert len(ids) == len(set(ids)) and sorted(ids) == epoch_ids(data)
