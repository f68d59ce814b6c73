"""Test modules marked `alone` run with no other test beside them when pytest-xdist runs two test processes.

Their multi-node Ray clusters on this machine time node deaths, drains and additions against Ray's own clocks;
beside another process's Ray runs (load 7-9 on 2 cores) a node-added run started at 2 workers and a drained node's
run failed (2026-11-27). Every other test holds a shared lock while it runs; an `alone` module holds the lock
exclusively from its first fixture to its last teardown. A gate lock keeps a waiting module from being starved
by the stream of shared holders: whoever wants the lock takes the gate first, and a module keeps the gate until
it has the lock. Without xdist (one process) the locks are never contended."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _lock_dir() -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")   # the same in every process of one xdist run
    return Path(tempfile.gettempdir()) / f"raydl-tests-{run}" if run else None


@contextmanager
def holding(exclusive: bool) -> Iterator[None]:
    where = _lock_dir()
    if where is None:
        yield
        return
    where.mkdir(exist_ok=True)
    with open(where / "gate", "a") as gate, open(where / "lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
