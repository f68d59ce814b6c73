"""The elastic scaling policies raydl's controller runs: Ray's, counting only nodes whose raylet answers now
(`LiveNodesElasticPolicy`), and on the survivors path one that leaves a smaller cluster to torchft
(`SurvivorsElasticPolicy`).

Ray's ElasticScalingPolicy sizes a worker group from the resources its AutoscalingCoordinator reserved, and
the coordinator refreshes its view of the nodes every 20 s. The GCS itself declares a lost node dead only
after its health checks fail (16 s measured here with Ray's defaults). So the restart that follows a node
loss within a second still counts the dead node's CPUs, asks for the old size, and waits out the worker
start timeout (scaling.worker_start_timeout_s) before it tries the smaller size (shared/RAY_NOTES.md, P4).
Here every decision first drops the nodes that the GCS reports dead or whose raylet does not accept a TCP
connection: a vanished node's raylet port refuses or times out at once, while the GCS still lists it alive.
And a node added to the cluster is seen at the next check (scaling.resize_check_s), not up to 20 s later: the
policy asks the coordinator to refresh its view of the nodes (its `recompute`, one `ray.nodes()`) at most once
per check.
"""

from __future__ import annotations

import ray
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision, ResizeDecision
from ray.train.v2._internal.util import time_monotonic

from raydl.driver.cluster_watch import raylet_answers


def live_only(reserved: dict[str, dict[str, float]], nodes: list[dict], answers=raylet_answers) -> dict[str, dict[str, float]]:
    """`reserved` (node id -> resources) without the nodes that `nodes` (ray.nodes()) lists as dead or not at
    all, or whose raylet does not answer."""
    live = {node["NodeID"] for node in nodes if node.get("Alive") and node["NodeID"] in reserved and answers(node)}
    return {node_id: resources for node_id, resources in reserved.items() if node_id in live}


class LiveNodesElasticPolicy(ElasticScalingPolicy):
    def __init__(self, scaling_config):
        super().__init__(scaling_config)
        self._latest_view_refresh_time = float("-inf")

    def _get_reserved_resources(self):
        self._maybe_refresh_coordinator_view()
        reserved = super()._get_reserved_resources()
        return None if reserved is None else live_only(reserved, ray.nodes())

    def _maybe_refresh_coordinator_view(self) -> None:
        """Ask the coordinator to re-read the nodes before the query that follows (an actor runs one caller's
        calls in order), at most once per resize check; the answer is not awaited."""
        now = time_monotonic()
        if now - self._latest_view_refresh_time < self.scaling_config.elastic_resize_monitor_interval_s:
            return
        self._latest_view_refresh_time = now
        self._autoscaling_coordinator.get_reserved_resources.remote(self._requester_id, recompute=True)


def replaces_alone(error, size: int | None) -> bool:
    """Whether Ray's controller replaces the failed replica groups alone for `error` (a failure of some but not
    all of the `size` workers, each a replica group of one on the survivors path), provided the decided worker
    count is still `size` (controller._execute_resize_decision)."""
    failed = getattr(error, "worker_failures", None)   # a WorkerGroupError's failed ranks; a controller error has none
    return bool(size) and failed is not None and 0 < len(failed) < size


class SurvivorsElasticPolicy(LiveNodesElasticPolicy):
    """The survivors path's elastic policy (raydl.train.survivors): a smaller cluster is torchft's to handle.

    Ray 2.60 replaces a failed replica group alone only when the decided worker count equals the current one; an
    elastic decision for the smaller cluster a node loss leaves would restart the whole group. So after a failure
    of some workers this policy keeps the group's size: the controller replaces them, each replacement waits for
    a place (its placement-group bundle, rescheduled by Ray onto the next node that has room) while the
    survivors train on at the smaller size, and joins when a node comes. A start or a restart of the whole group
    is sized as Ray's elastic policy sizes it; a running group is never shrunk by a restart, only grown."""

    def __init__(self, scaling_config):
        super().__init__(scaling_config)
        self._size: int | None = None        # the worker count of the group last started
        self._replacing = False              # the controller is replacing failed replica groups

    def on_controller_start_worker_group(self, *, scaling_config, num_workers: int):
        self._size = num_workers
        return super().on_controller_start_worker_group(scaling_config=scaling_config, num_workers=num_workers)

    def after_controller_state_update(self, previous_state, current_state):
        from ray.train.v2._internal.execution.controller.state import RestartingState, RunningState

        super().after_controller_state_update(previous_state, current_state)
        if isinstance(current_state, RestartingState):
            self._replacing = replaces_alone(current_state.training_failed_error, self._size)
        elif isinstance(current_state, RunningState):
            self._replacing = False
        # ReschedulingState (a replacement that could not start, e.g. on the node being lost): unchanged

    def make_decision_for_non_running_worker_group(self):
        if self._replacing:
            self._maybe_send_resource_request()
            return self._get_resize_decision(self._size)
        return super().make_decision_for_non_running_worker_group()

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if isinstance(decision, ResizeDecision) and decision.num_workers < worker_group_state.num_workers:
            return NoopDecision()   # fewer fit (a node not answering): its workers are replaced if they fail
        return decision
