"""Ray Train controller-side callback: tells the metrics sink why a worker group failed.

Step records reach the sink from rank 0 directly (raydl.metrics.sink); the controller is the one place
that sees a worker's error, so the restart that follows is written down with its cause. The ranks it saw tell
the sink which worker errors the controller has looked at (raydl.driver.finished_watch).
"""

from __future__ import annotations

from ray.train.v2.api.callback import UserCallback


class FailureCauseCallback(UserCallback):
    def __init__(self, sink_name: str):
        self.sink_name, self.sink = sink_name, None

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        import ray

        rank, error = next(iter(worker_exceptions.items()))
        first_line = str(error).splitlines()[0][:200] if str(error) else ""
        self.sink = self.sink or ray.get_actor(self.sink_name)
        self.sink.note_failure.remote(f"rank {rank}: {type(error).__name__}: {first_line}", list(worker_exceptions))
