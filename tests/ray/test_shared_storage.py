"""A cluster of several nodes refuses local checkpoint storage (a node that dies takes its disk, and the
checkpoints on it, with it) unless checkpoint.shared_local says the path is on NFS; a bucket is accepted.
Likewise a local dataset, unless data.shared_local says every node has it (then each node's copy is checked).
On the fake multi-node cluster of the fault tests (raydl.bench.fault_cluster: a head and one more node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.bench.fault_cluster import FaultCluster
from tests.helpers import free_port
from tests.ray.ray_head import alive_nodes, short_tmp_dir, start_head, stop_head
from tests.ray.test_autoscale import fake_cluster_config

pytestmark = [pytest.mark.slow]
RAYDL = str(Path(sys.executable).parent / "raydl")


def train(cwd: Path, address: str, data_cache: Path, *sets: str) -> subprocess.CompletedProcess:
    base = [f"data.cache_dir={data_cache}", "data.builtin_samples=4096", f"run.runs_dir={cwd / 'runs'}",
            "train.max_steps=10", "checkpoint.every_steps=10", "telemetry.report_every=10", "train.eval_batches=1",
            "telemetry.progress=false", *sets]
    return subprocess.run([RAYDL, "-q", "train", "--address", address, *(a for s in base for a in ("--set", s))],
                          cwd=cwd, capture_output=True, text=True, timeout=400)


def test_multi_node_cluster_refuses_local_checkpoints_and_data_but_takes_a_bucket(s3_bucket, data_cache, tmp_path):
    cluster = FaultCluster()        # after s3_bucket: its raylets inherit the AWS_* env that reaches the bucket
    try:
        cluster.resize(1)
        for local in ([], [f"checkpoint.storage_path={tmp_path / 'ckpt'}"]):
            p = train(tmp_path, cluster.address, data_cache, *local)
            assert p.returncode == 2 and p.stdout == "", p.stderr[-3000:]
            error = p.stderr[p.stderr.index("raydl: error:"):].strip()
            assert "config field 'checkpoint.storage_path' is" in error and "the cluster has 2 nodes" in error
            assert "checkpoint.shared_local=true" in error and error.count("\n") == 0
            assert not any((tmp_path / "runs").iterdir()) and not (tmp_path / "ckpt").exists()   # nothing written
        in_bucket = f"checkpoint.storage_path={s3_bucket}/ckpt"
        p = train(tmp_path, cluster.address, data_cache, in_bucket)      # the dataset is still local
        assert p.returncode == 2 and p.stdout == "", p.stderr[-3000:]
        error = p.stderr[p.stderr.index("raydl: error:"):].strip()
        assert f"config field 'data.cache_dir' is the local path '{data_cache}" in error and "2 nodes" in error
        assert "data.shared_local=true" in error and error.count("\n") == 0
        p = train(tmp_path, cluster.address, data_cache, in_bucket, "data.shared_local=true")   # checked on each node
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout)["steps"] == 10
    finally:
        cluster.shutdown()


def test_an_autoscaling_cluster_of_one_node_refuses_local_checkpoints(data_cache, tmp_path):
    """One node now, but an autoscaler that can add more (RAY_NOTES 6's fake provider): refused as well."""
    tmp = short_tmp_dir()
    gcs_port = free_port()
    head = start_head(tmp, num_cpus=2, gcs_port=gcs_port, autoscaling_config=fake_cluster_config(tmp, gcs_port),
                      env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    try:
        assert len(alive_nodes(head)) == 1
        argv = [RAYDL, "-q", "train", "--address", f"127.0.0.1:{gcs_port}", "--set", f"data.cache_dir={data_cache}",
                "--set", "data.builtin_samples=4096", "--set", f"run.runs_dir={tmp_path / 'runs'}"]
        p = subprocess.run(argv, cwd=tmp_path, env=head.client_env(token_env=True), capture_output=True, text=True,
                           timeout=300)
    finally:
        stop_head(head)
    assert p.returncode == 2 and p.stdout == "", p.stderr[-3000:]
    assert "the cluster has an autoscaler that can add nodes" in p.stderr and "checkpoint.shared_local" in p.stderr
    assert not any((tmp_path / "runs").iterdir())


def test_a_node_whose_copy_of_the_dataset_differs_is_named(ray_session, tmp_path):
    """The per-node check on this one-node cluster: a zero-CPU task pinned to the node reads its manifest.json."""
    from raydl.data.manifest import manifest_digest
    from raydl.driver.shared_storage import nodes_without

    dataset = tmp_path / "ds"
    dataset.mkdir()
    (dataset / "manifest.json").write_text('{"splits": {}}')
    nodes = [n for n in ray_session.nodes() if n["Alive"]]
    assert nodes_without(str(dataset), manifest_digest(str(dataset)), nodes) == []
    assert nodes_without(str(dataset), "0" * 64, nodes) == [nodes[0]["NodeManagerAddress"]]
    assert nodes_without(str(tmp_path / "absent"), None, nodes) == [nodes[0]["NodeManagerAddress"]]
