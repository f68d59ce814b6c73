"""The elastic scaling policy raydl's controller runs: Ray's, counting only nodes whose raylet answers now.

Ray's ElasticScalingPolicy sizes a worker group from the resources its AutoscalingCoordinator reserved, and
the coordinator refreshes its view of the nodes every 20 s. The GCS itself declares a lost node dead only
after its health checks fail (16 s measured here with Ray's defaults). So the restart that follows a node
loss within a second still counts the dead node's CPUs, asks for the old size, and waits out the worker
start timeout (scaling.worker_start_timeout_s) before it tries the smaller size (shared/RAY_NOTES.md, P4).
Here every decision first drops the nodes that the GCS reports dead or whose raylet does not accept a TCP
connection: a vanished node's raylet port refuses or times out at once, while the GCS still lists it alive.
"""

from __future__ import annotations

import ray
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

from raydl.driver.cluster_watch import raylet_answers


def live_only(reserved: dict[str, dict[str, float]], nodes: list[dict], answers=raylet_answers) -> dict[str, dict[str, float]]:
    """`reserved` (node id -> resources) without the nodes that `nodes` (ray.nodes()) lists as dead or not at
    all, or whose raylet does not answer."""
    live = {node["NodeID"] for node in nodes if node.get("Alive") and node["NodeID"] in reserved and answers(node)}
    return {node_id: resources for node_id, resources in reserved.items() if node_id in live}


class LiveNodesElasticPolicy(ElasticScalingPolicy):
    def _get_reserved_resources(self):
        reserved = super()._get_reserved_resources()
        return None if reserved is None else live_only(reserved, ray.nodes())
