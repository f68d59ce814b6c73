"""What the sweep driver notes and says while Tune runs: a line per trial start and end, the trials Tune
completed (COMPLETED_FILE), the start times (STARTS_FILE), and raydl's own trial errors kept off the console."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ray.tune import Callback

from raydl.errors import raydl_error_in
from raydl.metrics.sink import WORKERS_LOG
from raydl.tune.trial import TRIALS_DIR, attempts_of

TUNE_DIR, COMPLETED_FILE, STARTS_FILE = "tune", "completed_trials.txt", "trial_starts.jsonl"

log = logging.getLogger(__name__)


class Progress(Callback):
    """One line per trial start/end on the driver (Tune's own status table is turned off).

    Also notes every trial Tune completed (finished or stopped by ASHA) in COMPLETED_FILE: a trial
    that an interrupt cut short is stopped too, but without this call, so the file tells them apart.
    """

    def __init__(self, sweep_dir: Path):
        self.completed = sweep_dir / COMPLETED_FILE

    def on_trial_start(self, iteration, trials, trial, **info):
        note_start(self.completed.parent, trial=trial.trial_id)
        log.info(f"trial {trial.trial_id} started: {_short(trial.config)}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        with self.completed.open("a") as f:
            f.write(trial.trial_id + "\n")
        log.info(f"trial {trial.trial_id} finished")

    def on_trial_error(self, iteration, trials, trial, **info):
        sweep_dir = self.completed.parent
        attempts = attempts_of(sweep_dir / TRIALS_DIR / trial.trial_id)
        logs = [str(attempts[-1] / WORKERS_LOG)] if attempts and (attempts[-1] / WORKERS_LOG).exists() else []
        if trial.error_file:   # Tune writes it in its staging directory, synced to the sweep's tune/ from there
            logs.append(str(sweep_dir / TUNE_DIR / trial.trial_id / Path(trial.error_file).name))
        where = " and ".join(logs)
        log.info(f"trial {trial.trial_id} failed (recorded as infeasible)" + (f"; traceback in {where}" if where else ""))


class QuietRaydlTrialErrors(logging.Filter):
    """Tune logs a failed trial's error with its traceback on the console. One that raydl raised (bad data, a
    diverged loss) is said by the failed-trial line and the report's row, and its traceback is in the files
    that line names (Tune's error.txt, the attempt's workers.log): it is dropped here, below -v."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None or raydl_error_in(record.exc_info[1]) is None


def note_start(sweep_dir: Path, **what: str) -> None:
    """One line of STARTS_FILE: the sweep's start ({}) or a trial's (trial=ID), at the driver's clock now."""
    with (sweep_dir / STARTS_FILE).open("a") as f:
        f.write(json.dumps({**what, "time": time.time()}) + "\n")


def read_starts(sweep_dir: Path) -> list[dict[str, Any]]:
    path = sweep_dir / STARTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _short(config: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v:.3g}" if isinstance(v, float) else f"{k.split('.')[-1]}={v}"
                     for k, v in config.items())
