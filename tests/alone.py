"""Test modules marked `alone` run with no other Ray test beside them when pytest-xdist runs two test processes.

Their multi-node Ray clusters on this machine time node losses against Ray's own clocks (the survivors' Lighthouse
timeouts). The fault, restart-from-memory, shared-storage and autoscaler modules were alone until 2026-11-29: beside another process's Ray runs (load 7-9 on 2 cores) a node-added run started at 2 workers and
a drained node's run failed (2026-11-27), the change coming too late; their runs now hold at a known step until the
change has happened (debug.hold_at_step), and the suite is CPU-bound, so running them alone bought no time. Every
other Ray test holds a shared lock while it runs; an `alone` module holds the lock exclusively from its first
fixture to its last teardown. The module asks without blocking, once a second, so the other process's Ray tests keep
the lock between them (a blocked request would be granted in the gap between two of them, and the second would wait
for the whole module): the module starts once the other process runs no Ray test, which tests/conftest.py's order
makes the end of its Ray tests. Without xdist (one process) nothing waits."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _lock_file() -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")   # the same in every process of one xdist run
    return Path(tempfile.gettempdir()) / f"raydl-tests-{run}.lock" if run else None


@contextmanager
def holding(exclusive: bool) -> Iterator[None]:
    where = _lock_file()
    if where is None:
        yield
        return
    with open(where, "a") as lock:
        if exclusive:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(1.0)
        else:
            fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
