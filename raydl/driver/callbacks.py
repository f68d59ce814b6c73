"""Ray Train controller-side callback: tells the metrics sink why a worker group failed.

Step records reach the sink from rank 0 directly (raydl.metrics.sink); the controller is the one place
that sees a worker's error, so the restart that follows is written down with its cause. The ranks it saw tell
the sink which worker errors the controller has looked at (raydl.driver.finished_watch).
"""

from __future__ import annotations

import re

from ray.exceptions import RayActorError
from ray.train.v2.api.callback import UserCallback

from raydl.errors import raydl_error_in

# Ray's words for a worker process that ended without a Python error: a signal (SIGKILL), the OOM killer, a crash.
ENDED_ABRUPTLY = "exits with a connection error code"


def dead_worker(error: Exception) -> RayActorError | None:
    """The actor error of a worker whose process died (Train's health check wraps it), else None."""
    failure = getattr(error, "health_check_failure", error)
    return failure if isinstance(failure, RayActorError) else None


def failure_cause(rank: int, error: Exception) -> str:
    """One line: "rank 1 (pid 42) on node 10.0.0.5 died (...)" for a dead worker, else "rank 0: Type: message"."""
    dead = dead_worker(error)
    if dead is None:
        first_line = str(error).splitlines()[0][:200] if str(error) else ""
        return f"rank {rank}: {type(error).__name__}: {first_line}"
    text = str(dead)
    pid, ip = re.search(r"\bpid: (\d+)", text), re.search(r"\bip: (\S+)", text)
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    how = ("its process ended without a Python error: a signal such as SIGKILL, the OOM killer, or a crash"
           if ENDED_ABRUPTLY in text else f"Ray: {exit_type.group(1) if exit_type else type(dead).__name__}")
    return f"rank {rank}{f' (pid {pid.group(1)})' if pid else ''}{f' on node {ip.group(1)}' if ip else ''} died ({how})"


class FailureCauseCallback(UserCallback):
    def __init__(self, sink_name: str, *, deaths_said_elsewhere: bool = False):
        """`deaths_said_elsewhere`: the survivors path, where raydl.driver.member_watch says a dead worker's line
        (with what happens next): this one would repeat it."""
        self.sink_name, self.sink, self.deaths_said_elsewhere = sink_name, None, deaths_said_elsewhere

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        import ray

        # A dead worker first: the others' errors (a collective cut off) follow from its death.
        rank, error = min(worker_exceptions.items(), key=lambda item: (dead_worker(item[1]) is None, item[0]))
        self.sink = self.sink or ray.get_actor(self.sink_name)
        # A raydl error ends the run at once with its own paragraph (raydl.driver.failure_policy): nothing to announce.
        said_elsewhere = self.deaths_said_elsewhere and dead_worker(error) is not None
        self.sink.note_failure.remote(failure_cause(rank, error), list(worker_exceptions),
                                      announce=raydl_error_in(error) is None and not said_elsewhere)
