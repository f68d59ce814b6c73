"""Autoscaling for real, locally: a raydl elastic job grows the cluster, grows onto it, and the idle nodes go.

Head: `ray start --head --num-cpus=1` with Ray's fake multi-node provider (RAY_FAKE_CLUSTER=1; the config is
cluster/local-fake.yaml with the head's real GCS address), autoscaler update every 1 s, idle timeout 15 s.
Job: `python jobs/train.py` (raydl submit's entrypoint), elastic with scaling.min_workers=1, max_workers=2 (1 CPU per worker).

Expected sequence, each step polled with a deadline:
  1. training starts at world size 1 on the head's single CPU (or at 2, when the added node is up first), and holds
     after step HOLD;
  2. Train's elastic policy asks the autoscaler for max_workers bundles -> a `ray.worker.cpu` node (2 CPUs) is added;
  3. the run resizes 1 -> 2 workers (restart from its step-HOLD checkpoint), is released and finishes;
  4. the request is withdrawn and the idle node is removed.
Timings are printed with -s ([timing] lines).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import yaml

from raydl import job_package, jobs
from raydl.bench.fault_cluster import poll
from tests.helpers import free_port
from tests.ray.ray_head import alive_nodes, short_tmp_dir, start_head, stop_head

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# The scale-up must come while the run trains: the run holds after step HOLD (debug.hold_at_step: every rank waits,
# its checkpoint saved) until the test sees it at 2 workers and releases it, so the growth lands at a known step however
# slow the machine (until 2026-11-29: 200 steps of 256 samples, so that the 1-worker phase outlasted Train's
# AutoscalingCoordinator, which refreshes its view every 20 s, RAY_NOTES P4).
HOLD = 10
ELASTIC = ["--set", "scaling.min_workers=1", "--set", "scaling.max_workers=2", "--set", "scaling.resize_check_s=2",
           "--set", "train.max_steps=30", "--set", f"checkpoint.every_steps={HOLD}", "--set", "telemetry.report_every=10",
           "--set", "data.builtin_samples=4096", "--set", "train.eval_batches=2", "--set", f"debug.hold_at_step={HOLD}",
           # raydl's 15 s default gives up on a worker group that starts slowly; on a loaded 2-core box the first
           # (1-worker) group then dies and the retry starts at 2 workers, skipping the growth this test shows.
           "--set", "scaling.worker_start_timeout_s=60"]


def fake_cluster_config(tmp: Path, gcs_port: int) -> Path:
    from ray._private.services import get_node_ip_address

    cfg = yaml.safe_load((REPO / "cluster" / "local-fake.yaml").read_text())
    # Fake nodes join the GCS at this address (the file's placeholder is unroutable on purpose).
    cfg["provider"]["gcs_address"] = f"{get_node_ip_address()}:{gcs_port}"
    path = tmp / "autoscale.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ask_drivers_for_stacks(tmp: Path) -> list[int]:
    """Have each live driver of a job with `tmp` in its command line print its threads' stacks into the job's log
    (raydl's CLI: SIGUSR1); their pids."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and is_driver_of(p, str(tmp))]
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    return pids


def is_driver_of(proc: Path, tmp: str) -> bool:
    try:
        argv = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:   # ended meanwhile
        return False
    return argv[:2] == [b"python", b"jobs/train.py"] and tmp.encode() in b" ".join(argv)


def test_elastic_job_scales_fake_cluster_up_and_down():
    tmp = short_tmp_dir()
    gcs_port = free_port()
    head = start_head(tmp, num_cpus=1, gcs_port=gcs_port, autoscaling_config=fake_cluster_config(tmp, gcs_port),
                      env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    try:
        assert len(alive_nodes(head)) == 1   # the head only: worker types start at min_workers 0
        (tmp / "ledger").mkdir()
        client = jobs.Jobs(head.address, str(head.token_file))
        t0 = time.monotonic()
        # Like a real cluster, every node must see the data and the run dir: on one machine any absolute path
        # is "shared storage". Relative defaults would land in the job's working dir.
        shared = [f"data.cache_dir={tmp / 'data'}", f"run.runs_dir={tmp / 'runs'}", "checkpoint.shared_local=true",
                  "data.shared_local=true", f"debug.ledger_dir={tmp / 'ledger'}"]
        # The job's working dir is the repository in place (a `local://` URI, as on a cluster whose nodes share a
        # filesystem), not an uploaded package: Ray's runtime-env agent on each node unpacks a package at its
        # first use of it with overwrite=True (rmtree, then extract), and this fake cluster's nodes are started
        # by the head's autoscaler in the head's session dir, so the node added mid-run wiped the directory the
        # head's Train controller ran in (FileNotFoundError from os.getcwd, in CI). On a real cluster every node
        # unpacks into its own disk; the upload itself is test_jobs_submit's.
        command = ["train", *ELASTIC, *(arg for kv in shared for arg in ("--set", kv))]
        job_id = client.submit(job_package.entrypoint(command),
                               {"working_dir": f"local://{REPO}", "env_vars": job_package.parse_env([])})
        times = {}

        def progress() -> bool:
            now = time.monotonic() - t0
            status = client.status(job_id)
            if status == "RUNNING":
                times.setdefault("running", now)
            if len(alive_nodes(head)) > 1:
                times.setdefault("node_added", now)
            logs = client.logs(job_id)
            for size in (1, 2):
                if f"[raydl] {size} worker{'s' if size > 1 else ''}:" in logs:   # the layout line
                    times.setdefault(f"world_size_{size}", now)
            if "world_size_2" in times:
                (tmp / "ledger" / "release").touch()
            return status in jobs.TERMINAL and status

        def describe() -> str:
            # Where the job's driver is, if it has not ended (CI, 2026-12-06: it printed its summary and never did).
            stuck = ask_drivers_for_stacks(tmp)
            if stuck:
                with contextlib.suppress(TimeoutError):
                    poll("the driver's stacks in its log", lambda: "most recent call first" in client.logs(job_id), 20)
            return (f"timings so far (s since submit): {times}\nnodes: {alive_nodes(head)}\ndrivers still running, "
                    f"asked for their stacks: {stuck}\njob logs:\n" + "\n".join(
                        line for line in client.logs(job_id).splitlines() if "Reporting training result" not in line)[-12000:])

        status = poll("the elastic job finishing", progress, deadline_s=420, describe=describe, every_s=1)
        times["finished"] = time.monotonic() - t0
        logs = client.logs(job_id)
        assert status == "SUCCEEDED", logs[-4000:]
        run_dir = re.search(r'"run_dir": "([^"]+)"', logs).group(1)
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        assert summary["steps"] == 30
        # Started small and grew onto the new node; or, when the fake node came up before the first worker group
        # was placed (a race with the autoscaler's 1 s updates, seen once in CI), started at 2 on it. Either way the
        # job's request grew the cluster and the run trained on the added node (the 1 -> 2 resize itself is
        # test_faults' test_node_added_then_lost_without_notice_grows_and_shrinks).
        assert summary["world_sizes"] in ([1, 2], [2]), summary["world_sizes"]
        assert times["node_added"] < times["world_size_2"], times
        assert all(r["step"] == HOLD for r in summary["restarts"]), summary["restarts"]   # the held group went no further
        added = [n for n in alive_nodes(head) if not n["is_head_node"]]
        assert added and all(n["resources_total"].get("CPU") == 2 for n in added)   # ray.worker.cpu nodes

        t_end = time.monotonic()
        poll("idle worker nodes being removed", lambda: len(alive_nodes(head)) == 1, deadline_s=150,
             describe=lambda: f"nodes: {alive_nodes(head)}", every_s=1)
        times["scale_down_after_finish"] = time.monotonic() - t_end
        print("\n[timing] " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()) +
              f" (since submit; scale-down since the job ended); summary world_sizes {summary['world_sizes']}, "
              f"restarts {summary['restarts']}")
    finally:
        print(f"[autoscale] stopped {stop_head(head)} leftover fake-node processes after the head")
