"""The metrics sink: a small Ray actor that holds the run's MetricsWriter, on the driver's node.

Rank 0 sends each batch of step records to it fire-and-forget (`write.remote`), so metrics reach the run
directory without a barrier across workers and without waiting for Ray Train's controller, which drains
`ray.train.report` once per poll (one report in flight per worker: a second one waits up to a poll).
`ray.train.report` is left for what Train must see, checkpoints. Ray runs an actor's calls from one caller
in order, so the records arrive as rank 0 sent them; the final report is waited for, so summary.json is
written before the train function returns. The controller tells the sink why a worker group failed, and the
workers send it their error tracebacks (raydl.train.tracebacks), which it appends to the run's workers.log.
On the survivors path a failing worker also sends its error, kept until the controller reports it: the driver's
FinishedRunWatch ends the run with it when the controller, waiting to place a replacement, never does.

The console lines of the run (the layout, progress) are kept here and printed by the driver (`relay_lines`):
printed in this actor, Ray would forward them with its "(MetricsSink pid=...)" prefix.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from raydl.console import Console, Progress
from raydl.metrics.writer import MetricsWriter
from raydl.node_actor import start_on_this_node
from raydl.telemetry.records import WorkerReport

log = logging.getLogger(__name__)

RELAY_EVERY_S = 0.5
WORKERS_LOG = "workers.log"   # the workers' error tracebacks (raydl.train.tracebacks), in the run directory


class MetricsSink:
    def __init__(self, run_dir: str, progress: bool, events_dir: str | None, trackers: dict, mirror: str | None):
        self.lines: list[str | Progress] = []
        self.unseen_error: tuple | None = None   # (time, rank, error, traceback): note_worker_error's, until seen
        self.stop_signum = 0                     # request_stop's
        self.writer = MetricsWriter(run_dir, progress=progress, events_dir=events_dir, trackers=trackers, say=self.say,
                                    mirror=mirror)

    def write(self, report: WorkerReport, world_size: int) -> None:
        """`report` travels as the object (pickled by reference to its class): a tenth of a millisecond of rank 0's
        time, where turning it into a dict first took half a millisecond per report."""
        self.writer.write(report, world_size=world_size)

    def note_failure(self, cause: str, ranks: list[int], announce: bool = True) -> None:
        """From Ray Train's controller: the worker group failed, with errors from `ranks`. `announce`: say so on
        the console (a raydl error has its own paragraph); Ray's lines about it are in the run's ray.log
        (raydl.driver.ray_output)."""
        if self.unseen_error and self.unseen_error[1] in ranks:
            self.unseen_error = None
        if announce and not self.writer.preempted:
            self.say(f"a worker failed: {cause}")
        self.writer.note_failure(cause)

    def note_member(self, told: dict, line: str) -> None:
        """From Ray Train's controller on the survivors path (raydl.driver.member_watch): a worker lost, or its
        replacement started; `line` for the console, if any."""
        if line:
            self.say(line)
        self.writer.note_member(told)

    def note_worker_error(self, rank: int, error: Exception, traceback: str) -> None:
        """From a worker on the survivors path whose train function is ending with `error`."""
        self.unseen_error = (time.time(), rank, error, traceback)

    def error_unseen(self) -> tuple | None:
        """The last worker error that Ray Train's controller has not reported (note_failure) since."""
        return self.unseen_error

    def request_stop(self, signum: int) -> None:
        """From the driver at its first SIGINT or SIGTERM (raydl.signals.SignalStop): the workers stop at their next
        report with a checkpoint, and the driver prints the command that resumes the run. The leading worker asks
        `stop_requested` at each report without waiting for the answer, and the ranks agree on it in the report's
        one collective (raydl.train.agree). The run's sink holds it: an actor of its own cost a process (~1.5 CPU-s)
        per run."""
        self.stop_signum = self.stop_signum or signum

    def stop_requested(self) -> int:
        """The driver's first stop signal; 0 = none."""
        return self.stop_signum

    def fail_trackers(self) -> None:
        self.writer.fail_trackers()

    def note_worker_log(self, text: str) -> None:
        with (self.writer.run_dir / WORKERS_LOG).open("a") as f:
            f.write(text)

    def say(self, line: str | Progress) -> None:
        self.lines.append(line)

    def take_lines(self) -> list[str | Progress]:
        lines, self.lines = self.lines, []
        return lines


def start_sink(name: str, run_dir: str, progress: bool, events_dir: str | None, trackers: dict, mirror: str | None):
    """The named sink actor, on this node: the run directory's."""
    return start_on_this_node(MetricsSink, name, run_dir, progress, events_dir, trackers, mirror)


@contextlib.contextmanager
def relay_lines(sink) -> Iterator[None]:
    """While the run trains, show the sink's console lines and progress in this process (the driver's), as its
    own (a bar when stderr is a terminal); the last ones once more after the run, then the bar ends. One request
    is in flight at a time, and a slow answer is waited for at the next tick, not dropped: the sink's start (an
    experiment tracker's, under load) can take longer than a tick, and its lines would be lost with a dropped
    answer."""
    import ray

    stopped, gone = threading.Event(), threading.Event()
    pending: list = []   # the take_lines request in flight, if any
    console = Console()

    def relay(wait_s: float) -> bool:
        """Print the answer to the request in flight if it comes within wait_s; True if it did."""
        try:
            if not pending:
                pending.append(sink.take_lines.remote())
            if not ray.wait(pending, timeout=wait_s)[0]:
                return False
            for item in ray.get(pending.pop()):
                console.show(item)
            return True
        except ray.exceptions.RayError:   # the sink is gone with its node or the cluster: nothing left to print
            gone.set()
            return False

    def relay_until_stopped() -> None:
        while not stopped.wait(RELAY_EVERY_S) and not gone.is_set():
            relay(0)

    thread = threading.Thread(target=relay_until_stopped, name="raydl-console", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stopped.set()
        thread.join(timeout=35)
        if not gone.is_set() and relay(30):   # that answer may be to a request older than the last lines
            relay(30)
        console.close()
