"""Runs on a `ray start` head of their own (one per module: a head's start is ~10 CPU-s of GCS, raylet, dashboard and
agents), in this order:

- On a shared cluster, Train's PlacementGroupCleaner and PreemptionWatcher start once the run has reported its first
  steps, not while its workers start (raydl.driver.late_start), and the run still finishes. On a fresh head: no
  guard actor of an earlier run may be listed.
- A run whose Ray cluster goes away says so in one paragraph (which cluster, what was saved, how to resume), and the
  command it prints resumes the run as printed: on a local Ray, since the cluster's address is gone with it. This
  test stops the head, so it runs last (tests/ray/test_cluster_lost.py until 2026-11-29, with a head of its own).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from raydl.bench.fault_cluster import poll
from tests.helpers import stop_processes
from tests.ray.ray_head import Head, short_tmp_dir, start_head, stop_head
from tests.ray.test_stop import first_record_written, first_step, printed, start

GUARDS = {"PlacementGroupCleaner", "PreemptionWatcher"}


@pytest.fixture(scope="module")
def head():
    started = start_head(short_tmp_dir(), num_cpus=3)
    yield started
    stop_head(started)   # the lost-cluster test has stopped it already; its leftovers, if any


def live_actor_classes(head: Head) -> set[str]:
    """Class names of the cluster's actors that are not dead (also those still being created)."""
    r = requests.get(f"{head.address}/api/v0/actors", params={"limit": 1000}, timeout=10,
                     headers={"Authorization": f"Bearer {head.token}"})
    r.raise_for_status()
    return {a["class_name"] for a in r.json()["data"]["result"]["result"] if a["state"] != "DEAD"}


@pytest.mark.slow
def test_guard_actors_start_after_the_first_report_and_the_run_finishes(head, data_cache, tmp_path):
    run_dir, ledger = tmp_path / "run", tmp_path / "ledger"
    # The run holds after its first report (debug.hold_at_step) until both guards are up, so it cannot end before
    # they start however slow the machine; it trained 120 steps (59.1 CPU-s) to outlast their start.
    sets = ["train.max_steps=50", "telemetry.report_every=40", "checkpoint.every_steps=40",
            f"data.cache_dir={data_cache}", "data.builtin_samples=4096", "train.eval_batches=2",
            "telemetry.progress=false", f"run.dir={run_dir}", f"debug.ledger_dir={ledger}", "debug.hold_at_step=40",
            "scaling.min_workers=1", "scaling.max_workers=1",   # one watcher per group, whatever its size
            "scaling.survivors=off"]   # replica groups (the survivors path) run no PreemptionWatcher at all
    argv = [str(Path(sys.executable).parent / "raydl"), "train", "--address", f"127.0.0.1:{head.gcs_port}",
            *[a for s in sets for a in ("--set", s)]]
    seen_before_report: list[set[str]] = []

    def workers_up_or_reported() -> bool:
        classes = live_actor_classes(head)   # listed first: a guard starts only after metrics.jsonl is written
        if not (run_dir / "metrics.jsonl").exists():
            seen_before_report.append(classes)
            return False
        return True

    ledger.mkdir()
    run = subprocess.Popen(argv, cwd=tmp_path, env=head.client_env(token_env=True), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        poll("the run's first report", lambda: run.poll() is not None or workers_up_or_reported(), 300, every_s=0.1)
        guards = poll("both guard actors, or the run's end",
                      lambda: "up" if GUARDS <= live_actor_classes(head) else run.poll() is not None and "ended", 120)
    finally:
        (ledger / "release").touch()
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out[-4000:]
    assert guards == "up", "the run ended before both guard actors were up"
    with_workers = [classes for classes in seen_before_report if "RayTrainWorker" in classes]
    assert with_workers, f"the workers were never seen before the first report: {seen_before_report}"
    assert all(not (classes & GUARDS) for classes in seen_before_report), seen_before_report


@pytest.mark.slow
def test_cluster_shut_down_mid_run_is_one_paragraph(head, data_cache, tmp_path):
    try:
        sets = ["train.max_steps=100000", "telemetry.report_every=5", "checkpoint.every_steps=10",
                f"data.cache_dir={data_cache}", "data.builtin_samples=4096"]
        argv = [str(Path(sys.executable).parent / "raydl"), "train", "--address", f"127.0.0.1:{head.gcs_port}",
                *[a for s in sets for a in ("--set", s)]]
        run = subprocess.Popen(argv, cwd=tmp_path, env=head.client_env(token_env=True), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        poll("a checkpoint of the run", lambda: run.poll() is not None or any(tmp_path.rglob("step_00000010")), 300)
    finally:
        stop_processes([head.proc.pid], grace_s=5)
    out, _ = run.communicate(timeout=300)
    own = [line for line in out.splitlines() if "pid=" not in line and not line.startswith("[20")]
    paragraph = [line for line in own if line.startswith("raydl: error:")]
    assert run.returncode == 1 and len(paragraph) == 1, out[-4000:]
    assert f"127.0.0.1:{head.gcs_port}" in paragraph[0] and "step_000000" in paragraph[0]
    assert "--resume" in paragraph[0] and not any("Traceback" in line for line in own), out[-4000:]

    argv = printed(paragraph[0], "raydl train --resume")
    run_dir = Path(argv[-1])
    assert argv == ["raydl", "train", "--resume", str(run_dir)], argv   # no --address of the cluster that went away
    resumed = start(argv, tmp_path)
    resumed_dir = first_record_written(tmp_path / "runs", resumed, timeout_s=300, besides=run_dir)
    resumed.send_signal(signal.SIGTERM)   # a resumed run stops at SIGTERM as at Ctrl-C (tests/ray/test_stop.py)
    out, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 128 + signal.SIGTERM, out[-4000:]
    assert printed(out, "raydl train --resume") == ["raydl", "train", "--resume", str(resumed_dir)]
    assert first_step(resumed_dir) > 10, out[-4000:]   # from the checkpoint the paragraph named, or a later one
