"""CPU seconds per test: this test process's and every process under it (the Ray it started and that Ray's workers
and actors, the `raydl` and torchrun commands and their private Rays).

Where the machine lets a process make a cgroup (root, as here and in CI), each test process moves itself into one
of its own at the start of the session and a test's CPU is that cgroup's counter before and after it: exact, every
process started from here counted however short it lived (the kernel's count). Elsewhere it is read from /proc:

a thread reads the tree once a second while a test runs and keeps each process's last reading (Ray's raylet does not
collect its workers' times when they exit): a process that lived under a second between two readings, and the last
second of one that ended, are missed (a private-Ray `raydl train` test read 10.7 CPU-s so; its whole pytest
run, collection and imports included, 15.6 read every 0.1 s; 10 gloo tests with forked ranks read a third of their
cgroup's count). The session's Ray idles at ~4% of a core, counted in whichever test runs.

The suite is CPU-bound (2026-11-29: 95-98% of two cores busy for its whole run), so a test's wall time depends on
what runs beside it; its CPU seconds do not, and they add up to the suite's time: about their sum over two cores.
Printed after pytest's durations, most first (`--cpu-top N`, default 30; 0 = off)."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from raydl.bench.procs import descendants, table

TICK = os.sysconf("SC_CLK_TCK")
KEY = "cpu_s"
EVERY_S = 1.0
CGROUP_V2, CGROUP_V1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpuacct")
_counter: Path | None = None   # this process's cgroup's CPU counter, once it has moved into one


def join_own_cgroup() -> None:
    """Move this process into a new cgroup of its own (what it starts from now on is in it too), if it can."""
    global _counter
    v2 = (CGROUP_V2 / "cgroup.controllers").exists()
    root = CGROUP_V2 if v2 else CGROUP_V1
    for earlier in root.glob("raydl-tests-*"):   # earlier runs' groups, once empty (rmdir refuses one in use)
        with contextlib.suppress(OSError):
            earlier.rmdir()
    group = root / f"raydl-tests-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:   # not root, or no such controller: the /proc reading
        return
    _counter = group / ("cpu.stat" if v2 else "cpuacct.usage")


def _cgroup_cpu_s() -> float:
    text = _counter.read_text()
    if _counter.name == "cpuacct.usage":
        return int(text) / 1e9
    return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6


def _tree(root: int) -> dict[int, float]:
    """pid -> own CPU seconds of `root` and every live process under it (a collected child's are not in its
    parent's: it was read itself)."""
    processes = table()
    return {pid: processes[pid][1] / TICK for pid in (root, *descendants(root, processes)) if pid in processes}


class CgroupCpu:
    """start() ... stop() -> CPU seconds this process's cgroup used in between."""

    def start(self) -> None:
        self.before = _cgroup_cpu_s()

    def stop(self) -> float:
        return _cgroup_cpu_s() - self.before


class TreeCpu:
    """start() ... stop() -> CPU seconds the tree under this process used in between, read from /proc."""

    def __init__(self):
        self.before: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="cpu-watch", daemon=True)

    def _read(self) -> None:
        self.last.update(_tree(os.getpid()))

    def _watch(self) -> None:
        while not self.done.wait(EVERY_S):
            self._read()

    def start(self) -> None:
        self.before = _tree(os.getpid())
        self.last = dict(self.before)
        self.thread.start()

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        self._read()
        return sum(cpu - self.before.get(pid, 0.0) for pid, cpu in self.last.items())


def watch() -> CgroupCpu | TreeCpu:
    """A started watch of the CPU used from now until its stop(): the cgroup's count where this process has one."""
    cpu = CgroupCpu() if _counter else TreeCpu()
    cpu.start()
    return cpu


def summary_lines(reports, top: int) -> list[str]:
    per_test: dict[str, float] = {}
    for r in reports:
        for key, value in getattr(r, "user_properties", ()):
            if key == KEY:
                per_test[r.nodeid] = per_test.get(r.nodeid, 0.0) + value
    if not per_test or top <= 0:
        return []
    total = sum(per_test.values())
    how = "this process's cgroup" if _counter else "this process tree, read from /proc"
    lines = [f"CPU seconds per test ({how}): {total:.0f} in all, {total / 120:.1f} min on 2 cores"]
    lines += [f"{cpu:8.1f}s {nodeid}" for nodeid, cpu in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]]
    return lines
