"""The survivors path's changes of members on the run's record (summary.json's `members`), from two witnesses:

  * the leading worker (raydl.train.survivors.ChangeRecord, in its step records): the rank lost or joined, the
    step, the survivors' stall, the steps redone, the samples lost or repeated;
  * Ray Train's controller (raydl.driver.member_watch): where the worker ran and how it ended (its node, its
    process id, a signal or error, a lost node), or where its replacement started.

Either may come first (the controller sees a death at its next poll, the leader sends its records every
telemetry.report_every steps); they are matched by event and rank. What only one of them saw is kept as it is.
"""

from __future__ import annotations

from typing import Any


class MemberChanges:
    def __init__(self):
        self.changes: list[dict[str, Any]] = []          # the workers' records, with what Ray told added
        self._told: list[dict[str, Any]] = []            # what Ray told that no worker record matched yet

    def from_worker(self, change: dict[str, Any]) -> None:
        told = next((t for t in self._told if _same(t, change)), None)
        if told is not None:
            self._told.remove(told)
        self.changes.append({**(told or {}), **change})

    def from_ray(self, told: dict[str, Any]) -> None:
        """`told`: event, rank, time and Ray's details (node, pid, how)."""
        change = next((c for c in self.changes if _same(c, told) and "node" not in c), None)
        if change is None:
            self._told.append(told)
        else:
            change.update({k: v for k, v in told.items() if k not in change})

    def summary(self) -> list[dict[str, Any]]:
        """Every change, by time: a change Ray told of that no worker recorded (the run ended first) included."""
        return sorted([*self.changes, *self._told], key=lambda c: c["time"])


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["event"] == b["event"] and a["rank"] == b["rank"]
