"""What Ray Train's controller sees of the survivors path's changes of members, on the console and the run's record.

On the survivors path (raydl.train.survivors) Ray replaces a failed worker alone (`WorkerGroup.replace_replica_group`):
it shuts the failed worker's replica group down and starts a new one in its place, while the others train on.
This callback runs in the controller: its poll of the workers carries each failed worker's error, its replica-group
hooks say when Ray replaces one and when the replacement starts. At a replacement it tells the run's metrics sink,
which prints one line and keeps the record (raydl.metrics.members), for example

    worker 1 (pid 8671) on node 10.0.0.5 died: its process ended without a Python error (a signal such as
    SIGKILL, the OOM killer, or a crash); the other worker goes on; a replacement is starting

Ray does not say which signal or exit code ended a process (its raylet only sees the connection close): the line
says what Ray knows. The replacement's joining is the worker's own line (raydl.train.loop: "joined the others").
"""

from __future__ import annotations

import time
from typing import Any

from ray.train.v2._internal.execution.callback import ReplicaGroupCallback, WorkerGroupCallback

PROCESS_ENDED = "its process ended without a Python error (a signal such as SIGKILL, the OOM killer, or a crash)"
NODE_GONE = "its node is gone"


def how_it_ended(error: BaseException, *, node_answers: bool = True) -> str:
    """A worker's end as Ray's controller saw it, in a few words. `node_answers`: whether the worker's node's
    raylet still answers (Ray's first word of a lost node is often only that the actor is unavailable: its GCS
    declares the node dead after its health checks fail, seconds later)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    failure = getattr(error, "health_check_failure", error)   # Ray wraps a dead actor in its health check's error
    if isinstance(failure, RayActorError):
        text = str(failure)
        if failure.preempted:
            return "its node was preempted"
        if not node_answers or "node has died" in text:
            return NODE_GONE
        if "worker process has died" in text or isinstance(failure, ActorUnavailableError):
            return PROCESS_ENDED   # unavailable on a live node: its process's port is closed
        return "its Ray actor died"
    if type(failure).__name__ == "WorkerHealthCheckTimeoutError":
        return "it stopped answering Ray's health checks"
    first_line = (str(failure).splitlines() or [""])[0][:200]
    return f"it failed: {type(failure).__name__}: {first_line}".rstrip(": ")


def lost_line(rank: int, pid: int, node: str, how: str, others: int) -> str:
    goes_on = "the other worker goes on" if others == 1 else f"the other {others} workers go on"
    starts = "a replacement starts once a node has room for it" if how == NODE_GONE else "a replacement is starting"
    return f"worker {rank} (pid {pid}) on node {node} died: {how}; {goes_on}; {starts}"


class MemberWatch(WorkerGroupCallback, ReplicaGroupCallback):
    def __init__(self, sink_name: str):
        self.sink_name, self.sink = sink_name, None
        self.workers = 0                                  # the worker group's size
        self.errors: dict[int, BaseException] = {}        # rank -> its error, polled by the controller
        self.failing = 0                                  # workers with an error at the last poll that saw one

    def after_worker_group_start(self, worker_group) -> None:
        self.workers, self.errors = len(worker_group.get_workers()), {}

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        if worker_group_status.errors:
            self.errors.update(worker_group_status.errors)
            self.failing = len(worker_group_status.errors)

    def before_replica_group_shutdown(self, replica_group) -> None:
        """Ray replaces this replica group alone. A replacement that never started (no error polled) is not a loss."""
        for worker in [w for w in replica_group.get_workers() if _rank(w) in self.errors]:
            rank, meta = _rank(worker), worker.metadata
            how = how_it_ended(self.errors.pop(rank), node_answers=_node_answers(meta.node_id))
            others = max(self.workers - self.failing, 0)
            self._tell({"event": "lost", "rank": rank, "time": time.time(), "node": _node(meta), "pid": meta.pid,
                        "how": how}, lost_line(rank, meta.pid, _node(meta), how, others))

    def after_replica_group_start(self, replica_group) -> None:
        for worker in replica_group.get_workers():
            meta = worker.metadata
            self._tell({"event": "joined", "rank": _rank(worker), "time": time.time(), "node": _node(meta),
                        "pid": meta.pid}, "")

    def _tell(self, told: dict[str, Any], line: str) -> None:
        import ray

        try:
            self.sink = self.sink or ray.get_actor(self.sink_name)
            self.sink.note_member.remote(told, line)
        except ValueError:   # no sink (it died with its node): the run's record is gone with it
            pass


def _rank(worker) -> int:
    return worker.distributed_context.world_rank


def _node_answers(node_id: str) -> bool:
    import ray

    from raydl.driver.cluster_watch import raylet_answers

    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    return bool(node and node.get("Alive") and raylet_answers(node))


def _node(meta) -> str:
    return f"{meta.node_ip} ({meta.node_id[:8]})"
