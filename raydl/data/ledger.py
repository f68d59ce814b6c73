"""Test hook: a ledger of the sample ids each rank consumes, and a one-time injected failure.

    RAYDL_LEDGER_DIR=DIR       every loader appends to DIR/ledger-<pid>-dp<rank>.jsonl: a header line
                               {"start": {epoch, offset}, "t": time} and then, per step handed to
                               training, {"epoch", "offset" (position after the step), "ids"}.
    RAYDL_FAIL_AT_STEP=K       (with RAYDL_LEDGER_DIR) the first rank to reach global step K raises,
                               once per ledger dir (a marker file), to test restarts.

Off (no cost) unless RAYDL_LEDGER_DIR is set. The exactly-once tests in tests/*/test_data_ledger*.py
read these files: a step counts as consumed when it is at or before the checkpoint the next
attempt resumed from.
"""

from __future__ import annotations

import json
import os
import time

import torch

from raydl.data.order import DataPosition


class Ledger:
    def __init__(self, *, dp_rank: int, dp_size: int, start: DataPosition, steps_per_epoch: int, global_batch: int):
        self.dir = os.environ.get("RAYDL_LEDGER_DIR")
        self.fail_at = int(os.environ.get("RAYDL_FAIL_AT_STEP", -1))
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.steps_per_epoch, self.global_batch = steps_per_epoch, global_batch
        if self.dir:
            self.path = os.path.join(self.dir, f"ledger-{os.getpid()}-dp{dp_rank}.jsonl")
            self._write({"start": start.to_dict(), "t": time.time(), "dp_rank": dp_rank, "dp_size": dp_size})

    def record(self, position: DataPosition, ids: torch.Tensor) -> None:
        if not self.dir:
            return
        step = position.epoch * self.steps_per_epoch + position.offset // self.global_batch
        if step == self.fail_at and self._claim(f"failed-at-{step}"):
            raise RuntimeError(f"RAYDL_FAIL_AT_STEP: injected failure at step {step} (dp rank {self.dp_rank})")
        self._write({"epoch": position.epoch, "offset": position.offset, "ids": ids.tolist()})

    def _claim(self, name: str) -> bool:
        try:
            os.close(os.open(os.path.join(self.dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
