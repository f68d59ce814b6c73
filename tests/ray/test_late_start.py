"""On a shared cluster, Train's PlacementGroupCleaner and PreemptionWatcher start once the run has reported its
first steps, not while its workers start (raydl.driver.late_start), and the run still finishes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import requests

from raydl.bench.fault_cluster import poll
from tests.ray.ray_head import Head, short_tmp_dir, start_head, stop_head

GUARDS = {"PlacementGroupCleaner", "PreemptionWatcher"}


def live_actor_classes(head: Head) -> set[str]:
    """Class names of the cluster's actors that are not dead (also those still being created)."""
    r = requests.get(f"{head.address}/api/v0/actors", params={"limit": 1000}, timeout=10,
                     headers={"Authorization": f"Bearer {head.token}"})
    r.raise_for_status()
    return {a["class_name"] for a in r.json()["data"]["result"]["result"] if a["state"] != "DEAD"}


@pytest.mark.slow
def test_guard_actors_start_after_the_first_report_and_the_run_finishes(data_cache, tmp_path):
    head = start_head(short_tmp_dir(), num_cpus=3)
    run_dir = tmp_path / "run"
    sets = ["train.max_steps=120", "telemetry.report_every=40", "checkpoint.every_steps=40",
            f"data.cache_dir={data_cache}", "data.builtin_samples=4096", "train.eval_batches=2",
            "telemetry.progress=false", f"run.dir={run_dir}",
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

    try:
        run = subprocess.Popen(argv, cwd=tmp_path, env=head.client_env(token_env=True), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        poll("the run's first report", lambda: run.poll() is not None or workers_up_or_reported(), 300, every_s=0.1)
        guards = poll("both guard actors, or the run's end",
                      lambda: "up" if GUARDS <= live_actor_classes(head) else run.poll() is not None and "ended", 120)
        out, _ = run.communicate(timeout=300)
    finally:
        stop_head(head)
    assert run.returncode == 0, out[-4000:]
    assert guards == "up", "the run ended before both guard actors were up"
    with_workers = [classes for classes in seen_before_report if "RayTrainWorker" in classes]
    assert with_workers, f"the workers were never seen before the first report: {seen_before_report}"
    assert all(not (classes & GUARDS) for classes in seen_before_report), seen_before_report
