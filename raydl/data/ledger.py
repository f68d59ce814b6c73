"""Test hooks of the `debug` config section: a ledger of the sample ids each rank consumes, and a
one-time injected failure.

    debug.ledger_dir=DIR     every loader writes DIR/ledger-<pid>-dp<rank>[.<n>].jsonl: a header line
                             {"start": {epoch, offset}, "t", "dp_rank", "dp_size"} and then, per step
                             handed to training, {"epoch", "offset" (position after the step), "ids"}.
    debug.fail_at_step=K     the first rank to reach global step K raises, once per ledger dir (a
                             marker file), to test restarts.

The training loop hands a `Ledger` to the loader only when debug.ledger_dir is set; otherwise
the loader gets None and does nothing per batch. The exactly-once tests (tests/ray/test_data_ledger.py,
tests/ray/test_faults.py) read these files: a step counts as consumed when it is at or before
the checkpoint the next attempt resumed from.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from raydl.config import DebugSection
from raydl.data.order import DataPosition


@dataclass(frozen=True)
class Ledger:
    """What the debug section asks for; `open` binds it to one loader."""
    directory: str
    fail_at_step: int = -1

    @classmethod
    def from_config(cls, debug: DebugSection) -> "Ledger | None":
        return cls(debug.ledger_dir, debug.fail_at_step) if debug.ledger_dir else None

    def open(self, *, dp_rank: int, dp_size: int, start: DataPosition, steps_per_epoch: int,
             global_batch: int) -> "LedgerFile":
        return LedgerFile(self, dp_rank=dp_rank, dp_size=dp_size, start=start, steps_per_epoch=steps_per_epoch,
                          global_batch=global_batch)


class LedgerFile:
    """One loader's ledger: a header line at the start, then a line per step."""

    def __init__(self, ledger: Ledger, *, dp_rank: int, dp_size: int, start: DataPosition, steps_per_epoch: int,
                 global_batch: int):
        self.ledger, self.dp_rank = ledger, dp_rank
        self.steps_per_epoch, self.global_batch = steps_per_epoch, global_batch
        os.makedirs(ledger.directory, exist_ok=True)
        self.path = self._unused_path(ledger.directory, f"ledger-{os.getpid()}-dp{dp_rank}")
        self._write({"start": start.to_dict(), "t": time.time(), "dp_rank": dp_rank, "dp_size": dp_size})

    @staticmethod
    def _unused_path(directory: str, stem: str) -> str:
        """<stem>.jsonl, or <stem>.2.jsonl, ... for a process's later loaders (the survivors path opens one at
        every change of its members: each file is one loader, from its header's position on)."""
        n = 1
        while os.path.exists(path := os.path.join(directory, f"{stem}.jsonl" if n == 1 else f"{stem}.{n}.jsonl")):
            n += 1
        return path

    def record(self, position: DataPosition, ids: torch.Tensor) -> None:
        step = position.epoch * self.steps_per_epoch + position.offset // self.global_batch
        if step == self.ledger.fail_at_step and self._claim(f"failed-at-{step}"):
            raise RuntimeError(f"debug.fail_at_step: injected failure at step {step} (dp rank {self.dp_rank})")
        self._write({"epoch": position.epoch, "offset": position.offset, "ids": ids.tolist()})

    def _claim(self, name: str) -> bool:
        try:
            os.close(os.open(os.path.join(self.ledger.directory, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
