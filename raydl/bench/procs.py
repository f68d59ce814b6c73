"""This machine's processes, read from /proc: who is whose child, command lines, CPU use, killing one.

The benchmarks need these to describe what else loaded the machine while they ran and to inject faults
into Ray's worker processes; /proc is read directly because nothing in raydl's dependencies wraps it.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU ticks used so far) of `pid`; None once it has gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[11]) + int(fields[12])   # ppid; utime + stime
    except (OSError, IndexError, ValueError):
        return None


def table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks) of every live process."""
    stats = {int(entry.name): _stat(int(entry.name)) for entry in PROC.iterdir() if entry.name.isdigit()}
    return {pid: stat for pid, stat in stats.items() if stat}


def descendants(root: int, processes: dict[int, tuple[int, int]] | None = None) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in (processes or table()).items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def name(pid: int) -> str:
    """The command line, or for a kernel thread (which has none) its name in brackets as ps shows it."""
    try:
        return cmdline(pid) or f"[{(PROC / str(pid) / 'comm').read_text().strip()}]"
    except OSError:
        return ""


def busiest(count: int = 5, interval_s: float = 0.5) -> list[dict[str, object]]:
    """The `count` processes outside this process's tree that used the most CPU over the next `interval_s`."""
    before = table()
    time.sleep(interval_s)   # CPU use is a rate: two readings of the tick counters, `interval_s` apart
    after = table()
    ours = {os.getpid(), *descendants(os.getpid(), after)}
    ticks_per_s = os.sysconf("SC_CLK_TCK") * interval_s
    used = sorted(((after[pid][1] - before[pid][1], pid) for pid in after.keys() & before.keys() if pid not in ours),
                  reverse=True)
    return [{"pid": pid, "cpu_pct": round(100 * ticks / ticks_per_s), "cmd": name(pid)[:120]}
            for ticks, pid in used[:count] if ticks]


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def free_port() -> int:
    """A TCP port free on this machine now (for a gloo rendezvous or a Ray head started here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
