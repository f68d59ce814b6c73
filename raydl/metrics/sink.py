"""The metrics sink: a small Ray actor that holds the run's MetricsWriter, on the driver's node.

Rank 0 sends each batch of step records to it fire-and-forget (`write.remote`), so metrics reach the run
directory without a barrier across workers and without waiting for Ray Train's controller, which drains
`ray.train.report` once per poll (one report in flight per worker: a second one waits up to a poll).
`ray.train.report` is left for what Train must see, checkpoints. Ray runs an actor's calls from one caller
in order, so the records arrive as rank 0 sent them; the final report is waited for, so summary.json is
written before the train function returns. The controller tells the sink why a worker group failed.

The console lines of the run (the layout, progress) are kept here and printed by the driver (`relay_lines`):
printed in this actor, Ray would forward them with its "(MetricsSink pid=...)" prefix.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from raydl.console import Console, Progress
from raydl.metrics.writer import MetricsWriter
from raydl.node_actor import start_on_this_node
from raydl.telemetry.records import WorkerReport

log = logging.getLogger(__name__)

RELAY_EVERY_S = 0.5


class MetricsSink:
    def __init__(self, run_dir: str, progress: bool, events_dir: str | None):
        self.lines: list[str | Progress] = []
        self.writer = MetricsWriter(run_dir, progress=progress, events_dir=events_dir, say=self.say)

    def write(self, report: WorkerReport, world_size: int) -> None:
        """`report` travels as the object (pickled by reference to its class): a tenth of a millisecond of rank 0's
        time, where turning it into a dict first took half a millisecond per report."""
        self.writer.write(report, world_size=world_size)

    def note_failure(self, cause: str) -> None:
        self.writer.note_failure(cause)

    def say(self, line: str | Progress) -> None:
        self.lines.append(line)

    def take_lines(self) -> list[str | Progress]:
        lines, self.lines = self.lines, []
        return lines


def start_sink(name: str, run_dir: str, progress: bool, events_dir: str | None):
    """The named sink actor, on this node: the run directory's."""
    return start_on_this_node(MetricsSink, name, run_dir, progress, events_dir)


@contextlib.contextmanager
def relay_lines(sink) -> Iterator[None]:
    """While the run trains, show the sink's console lines and progress in this process (the driver's), as its
    own (a bar when stderr is a terminal); the last ones once more after the run, then the bar ends."""
    import ray

    stopped = threading.Event()
    console = Console()

    def relay() -> None:
        try:
            for item in ray.get(sink.take_lines.remote(), timeout=30):
                console.show(item)
        except ray.exceptions.RayError:   # the sink is gone with its node or the cluster: nothing left to print
            stopped.set()

    def relay_until_stopped() -> None:
        while not stopped.wait(RELAY_EVERY_S):
            relay()

    thread = threading.Thread(target=relay_until_stopped, name="raydl-console", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stopped.set()
        thread.join(timeout=35)
        relay()
        console.close()
