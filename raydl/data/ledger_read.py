"""The sample-id ledger (raydl.data.ledger, debug.ledger_dir) read back: which rows each worker-group attempt
took, which of them count (each attempt up to the position the next one started from), and what is left over.

Used by the exactly-once tests (tests/ray) and by `raydl bench recovery` (samples lost or repeated, steps redone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LoaderLog:
    """One loader's ledger file (raydl/data/ledger.py) as read back: its header and a record per step."""
    pid: int
    header: dict
    steps: list[dict]


def read_ledger(directory: Path) -> list[LoaderLog]:
    """Every ledger file in `directory` (a run's debug.ledger_dir), in the order the loaders started."""
    logs = []
    for path in directory.glob("ledger-*.jsonl"):
        header, *steps = _read_jsonl(path)
        logs.append(LoaderLog(int(path.name.split("-")[1]), header, steps))
    return sorted(logs, key=lambda log: log.header["t"])


def _read_jsonl(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:   # the last line of a SIGKILLed writer may be cut short
            pass
    return lines


@dataclass
class Attempt:
    """One worker group: where it started, its dp size, and each dp rank's step records."""
    start: dict             # {"epoch", "offset"}
    t: float
    dp_size: int
    ranks: dict[int, list[dict]] = field(default_factory=dict)


def attempts(directory: Path) -> list[Attempt]:
    """Ledger files grouped into worker-group attempts, in start-time order.

    Attempts follow each other. A file joins the attempt before it when it starts at the same
    position with the same dp size, unless its dp rank is already there and it started more than
    3 s later: pipeline ranks of one dp rank open their loaders together, a restart starts new
    processes seconds later. A new dp rank joins however late it came (a loaded machine)."""
    grouped: list[Attempt] = []
    for log in read_ledger(directory):
        last = grouped[-1] if grouped else None
        repeat = last is not None and log.header["dp_rank"] in last.ranks and log.header["t"] - last.t > 3.0
        if (last is None or repeat or log.header["start"] != last.start
                or log.header["dp_size"] != last.dp_size):
            last = Attempt(log.header["start"], log.header["t"], log.header["dp_size"])
            grouped.append(last)
        last.ranks.setdefault(log.header["dp_rank"], log.steps)   # pipeline ranks of one dp rank repeat it
    return grouped


def committed_ids(directory: Path) -> dict[int, list[int]]:
    """Epoch -> sample ids of the steps that count.

    Each attempt writes one ledger file per rank; pipeline ranks of one dp rank write the same ids, so
    one file per dp rank is read. An attempt's steps count up to the position the next attempt started
    from (the checkpoint it loaded); later ones were lost with the attempt and redone. The last attempt
    counts whole."""
    found = attempts(directory)
    ids: dict[int, list[int]] = {}
    for i, attempt in enumerate(found):
        limit = _position(found[i + 1].start) if i + 1 < len(found) else (1 << 62, 0)
        for steps in attempt.ranks.values():
            for step in steps:
                if _position(step) <= limit:
                    ids.setdefault(step["epoch"], []).extend(step["ids"])
    return ids


def _position(record: dict) -> tuple[int, int]:
    return record["epoch"], record["offset"]


def epoch_ids(data_dir: Path) -> list[int]:
    """The sample ids of one epoch: every row of the dataset's train shards, sorted."""
    import pyarrow.parquet as pq

    return sorted(i for f in data_dir.glob("train-*.parquet") for i in pq.read_table(f)["id"].to_pylist())


def steps_redone(directory: Path) -> int:
    """The most steps one loader handed out past the position its successor started from: steps taken again."""
    found = attempts(directory)
    redone = 0
    for attempt, after in zip(found, found[1:]):
        start = _position(after.start)
        for steps in attempt.ranks.values():
            redone = max(redone, sum(_position(s) > start for s in steps))
    return redone


def lost_and_repeated(directory: Path, data_dir: Path) -> tuple[int, int]:
    """(samples of an epoch never taken, samples taken twice or more in an epoch): (0, 0) when every sample was
    taken exactly once. An epoch the run ended inside counts for repeats only."""
    every, committed = set(epoch_ids(data_dir)), committed_ids(directory)
    last = max(committed, default=0)
    lost = repeated = 0
    for epoch, ids in committed.items():
        repeated += len(ids) - len(set(ids))
        if epoch < last or len(ids) >= len(every):
            lost += len(every - set(ids))
    return lost, repeated
