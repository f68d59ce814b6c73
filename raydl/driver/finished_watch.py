"""Ends a survivors-path run whose steps are all done while Ray Train still waits to place a replacement.

On the survivors path (raydl.train.survivors) a lost node's worker is replaced alone: Ray's controller asks for
the replacement and waits, without a timeout, until a node has room for it (Ray 2.60,
`WorkerGroup._replace_replica_group_impl`), while the survivors train on at the smaller size. When no node comes
back before the survivors finish, the run is complete (its last checkpoint registered, summary.json written by
the metrics sink), but the controller still waits, and Ray ends a run only when every worker has finished. This
watch sees the run's summary.json appear; if the controller has not returned `grace_s` later, it stops the
controller (its actors and placement group go with it) and the driver returns the run's result itself.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GRACE_S = 20.0   # a run that ends normally returns within seconds of its summary; stopping it early loses nothing


class FinishedRunWatch:
    def __init__(self, run_dir: Path, grace_s: float = GRACE_S):
        self.summary = Path(run_dir) / "summary.json"
        self.grace_s = grace_s
        self.controller: Any = None      # Ray Train's controller actor, once the trainer has made it
        self.ended_run = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raydl-finished-run-watch", daemon=True)

    def __enter__(self) -> "FinishedRunWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._done.wait(1.0):   # polling the run directory for the summary, until fit returns
            if self.summary.exists():
                break
        else:
            return
        if self._done.wait(self.grace_s) or self.controller is None:
            return
        import ray

        log.warning(f"every step is done but Ray Train still waits for a node to place a replacement worker on "
                    f"({self.grace_s:.0f} s after the run's summary): ending the run without it")
        self.ended_run = True
        ray.kill(self.controller)
