"""Ends a survivors-path run that Ray Train's controller cannot end while it waits to place a replacement.

On the survivors path (raydl.train.survivors) a lost node's worker is replaced alone: Ray's controller asks for
the replacement and waits, without a timeout, until a node has room for it (Ray 2.60,
`WorkerGroup._replace_replica_group_impl`), while the survivors train on at the smaller size. Meanwhile the
controller looks at no worker, so two ends of the run would never come:

  * the survivors finish every step (the last checkpoint registered, summary.json written by the metrics sink),
    but Ray ends a run only when every worker has finished. This watch sees the run's summary.json appear; if
    the controller has not returned `grace_s` later, it stops the controller.
  * a survivor fails (bad data, a bug): the controller would report it, or retry, only once a node came. The
    failing worker tells the metrics sink its error first (raydl.train.session.RaySession.failed), the
    controller tells the sink which ranks' errors it saw (raydl.driver.callbacks); an error the controller has
    not seen `failed_grace_s` later stops the controller, and the run ends with that error, as the controller
    would have raised it (`failure`).

Stopping the controller takes its actors and placement group with it; the driver then returns the run's result
itself (raydl.driver.failure_policy.ended_result).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GRACE_S = 20.0   # a run that ends normally returns within seconds of its summary; stopping it early loses nothing
FAILED_GRACE_S = 10.0   # the controller polls its workers every 0.5 s: one not seeing an error for 10 s is stuck


class FinishedRunWatch:
    def __init__(self, run_dir: Path, sink: Any = None, grace_s: float = GRACE_S,
                 failed_grace_s: float = FAILED_GRACE_S):
        self.summary = Path(run_dir) / "summary.json"
        self.sink = sink                 # the run's metrics sink actor, which keeps a failed worker's error
        self.grace_s, self.failed_grace_s = grace_s, failed_grace_s
        self.controller: Any = None      # Ray Train's controller actor, once the trainer has made it
        self.ended_run = False
        self.failure: tuple[int, Exception, str] | None = None   # (rank, error, traceback) the run ended with
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raydl-finished-run-watch", daemon=True)

    def __enter__(self) -> "FinishedRunWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        finished_at = None
        while not self._done.wait(1.0):   # polling the run directory and the sink, until fit returns
            if finished_at is None and self.summary.exists():
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at >= self.grace_s:
                self._end(f"the workers are done (every step, or stopped) but Ray Train still waits for a node to "
                          f"place a replacement worker on ({self.grace_s:.0f} s after the run's summary): ending the "
                          f"run without it")
                return
            unseen = self._error_unseen()
            if unseen and time.time() - unseen[0] >= self.failed_grace_s:
                self.failure = unseen[1:]
                self._end(f"worker {unseen[1]} failed while Ray Train waits for a node to place a replacement "
                          f"worker on (its error unseen by Ray {self.failed_grace_s:.0f} s later): ending the run "
                          f"with that error")
                return

    def _error_unseen(self) -> tuple | None:
        import ray

        if self.sink is None:
            return None
        try:
            return ray.get(self.sink.error_unseen.remote(), timeout=10)
        except ray.exceptions.RayError:   # the sink is gone with the cluster: the driver hears of it from Ray
            return None

    def _end(self, why: str) -> None:
        import ray

        if self.controller is None:
            return
        log.warning(why)
        self.ended_run = True
        ray.kill(self.controller)
