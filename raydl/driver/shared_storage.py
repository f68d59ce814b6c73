"""What a cluster of several nodes (or one an autoscaler may grow) needs of local paths: checkpoints on storage
that outlives a node, and a dataset every node can read.

A node that dies takes its local disk with it, and every worker reads the dataset on its own node: a local
path is accepted only when the user says every node has it (`checkpoint.shared_local`, `data.shared_local`),
and for the dataset raydl then checks each node's copy against the driver's before any worker starts.
"""

from __future__ import annotations

import json

from raydl import storage
from raydl.config import JobConfig
from raydl.data.manifest import manifest_digest
from raydl.errors import ConfigError, DataError

NODE_CHECK_TIMEOUT_S = 120.0


def check_shared_checkpoints(cfg: JobConfig) -> None:
    """Refuse local checkpoint storage on a cluster of several nodes, or one that may add some: a node that
    dies takes its local disk, and the checkpoint shards its workers wrote there, with it."""
    import ray

    c = cfg.checkpoint
    if not storage.is_local(c.storage_path) or c.shared_local:
        return
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if nodes <= 1 and not can_add_nodes():
        return
    where = f"'{c.storage_path}', a local path" if c.storage_path else "empty (the run directory, a local path)"
    cluster = f"{nodes} nodes" if nodes > 1 else "an autoscaler that can add nodes"
    raise ConfigError("checkpoint.storage_path", f"is {where}, but the cluster has {cluster}: a node that dies "
                      "takes its local disk with it, and the checkpoints with it",
                      "set checkpoint.storage_path to a bucket every node reaches (s3://BUCKET/PATH, gs://BUCKET/PATH), "
                      "or, if that path is on storage every node mounts (NFS), set checkpoint.shared_local=true")


def can_add_nodes() -> bool:
    """Whether an autoscaler with node types to launch watches this cluster. Ray's v2 autoscaler publishes its
    cluster config (what Ray Data's is_autoscaling_enabled reads); the legacy one, which `ray start
    --autoscaling-config` and the fake multi-node provider run, only its status, in which a cluster without a
    config shows each node as a read-only type of its own, node_<id>."""
    from ray._private import ray_constants
    from ray._private.state import state
    from ray._private.worker import global_worker
    from ray.autoscaler._private.util import format_readonly_node_type

    config = state.get_cluster_config()
    if config and any(g.max_count == -1 or g.max_count > g.min_count for g in config.node_group_configs):
        return True
    # This process's own GCS client: ray.experimental.internal_kv's is unset again by any ray.shutdown in it.
    status = global_worker.gcs_client.internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS.encode(), None)
    types = (json.loads(status).get("autoscaler_report") or {}).get("node_type_mapping") or {} if status else {}
    return any(kind != format_readonly_node_type(node) for node, kind in types.items())


def check_shared_dataset(cfg: JobConfig, data_path: str) -> None:
    """Refuse a local dataset on a cluster of several nodes, or one that may add some, unless data.shared_local
    says every node has it at that path; then check that each node now alive holds the driver's copy."""
    import ray

    if not storage.is_local(data_path):
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1 and not can_add_nodes():
        return
    field = "data.cache_dir" if cfg.data.path == "builtin" else "data.path"
    if not cfg.data.shared_local:
        cluster = f"{len(nodes)} nodes" if len(nodes) > 1 else "an autoscaler that can add nodes"
        raise ConfigError(field, f"is the local path '{data_path}', but the cluster has {cluster} and every worker "
                          "reads the dataset on its own node",
                          "put the dataset in a bucket every node reaches (`raydl data prepare --out s3://BUCKET/PATH`, "
                          "or data.cache_dir=s3://BUCKET/PATH for the built-in one), or, if that path is on storage "
                          "every node mounts (NFS) or copied to it on every node, set data.shared_local=true")
    missing = nodes_without(data_path, manifest_digest(data_path), nodes)
    if missing:
        raise DataError(f"{field} '{data_path}': {len(missing)} of the cluster's {len(nodes)} nodes hold no copy of "
                        f"this dataset there, or a different one ({', '.join(missing[:5])}). Fix: copy the dataset to "
                        f"that path on every node (the same manifest.json), or put it in a bucket "
                        f"(`raydl data prepare --out s3://BUCKET/PATH`); nothing was written.")


def nodes_without(data_path: str, digest: str | None, nodes: list[dict]) -> list[str]:
    """The addresses of the nodes whose manifest.json at `data_path` differs from `digest` (or is absent), each
    read by a zero-CPU task pinned to its node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    read = ray.remote(num_cpus=0)(manifest_digest)
    answers = [read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
               .remote(data_path) for n in nodes]
    digests = ray.get(answers, timeout=NODE_CHECK_TIMEOUT_S)
    return [n["NodeManagerAddress"] for n, d in zip(nodes, digests) if d != digest or d is None]
