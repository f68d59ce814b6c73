"""CPU seconds per test: this test process's and every process under it (the Ray it started and that Ray's workers
and actors, the `raydl` and torchrun commands and their private Rays), read from /proc before and after each test.

The suite is CPU-bound (2026-11-29: 98% of two cores busy for its whole run), so a test's wall time depends on what
runs beside it; its CPU seconds do not, and they add up to the suite's time: about the sum over tests / 2 on two
cores. A process that ended counts in its parent's children's time once the parent reaped it (the raylet reaps its
workers, the session's Ray is this process's child); a process whose parent ended first left the tree and is not
counted: the workers of a `raydl` command's private Ray, whose raylet that command stops. So a lower bound, low for
the tests whose commands start their own Ray. Printed after pytest's durations, most
first (`--cpu-top N`, default 30; 0 = off)."""

from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK")
KEY = "cpu_s"


def _stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, own CPU seconds plus those of its reaped children)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / TICK)
    return out


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds of `root` (this process) and every live process under it, with their reaped children's."""
    stats, root = _stats(), root or os.getpid()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(children.get(pid, ()))
    return total


def summary_lines(reports, top: int) -> list[str]:
    per_test: dict[str, float] = {}
    for r in reports:
        for key, value in getattr(r, "user_properties", ()):
            if key == KEY:
                per_test[r.nodeid] = per_test.get(r.nodeid, 0.0) + value
    if not per_test or top <= 0:
        return []
    total = sum(per_test.values())
    lines = [f"CPU seconds per test (this process tree): {total:.0f} in all, {total / 120:.1f} min on 2 cores"]
    lines += [f"{cpu:8.1f}s {nodeid}" for nodeid, cpu in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]]
    return lines
