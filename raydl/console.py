"""A run's progress on the console: one tqdm bar when stderr is a terminal, a line per report when it is not
(a log file, a pipe, CI), and nothing with --quiet.

The metrics writer (raydl.metrics.writer) makes a `Progress` per report. Whoever prints the run's lines shows
it: under Ray the driver, relaying the sink's lines (raydl.metrics.sink.relay_lines); under torchrun rank 0,
which holds the writer. raydl's other lines go through the "raydl" logger, whose handler clears the bar,
writes the line and redraws the bar below it (raydl.log).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"   # postfix: ", status"


@dataclass(frozen=True)
class Progress:
    step: int
    total: int      # 0: unknown
    status: str     # loss, rate, world size, cost, eta: beside the bar, or after "step N/T" in the line

    @property
    def line(self) -> str:
        return f"step {self.step}/{self.total} {self.status}"


class Console:
    """Shows a run's console items (a line, or a Progress) in this process; `close` ends the bar."""

    def __init__(self, *, terminal: bool | None = None):
        """`terminal`: draw a bar (None: when stderr is a terminal at the first progress)."""
        self.terminal, self.bar = terminal, None

    def show(self, item: str | Progress) -> None:
        if not isinstance(item, Progress):
            log.info(item)
        elif not log.isEnabledFor(logging.INFO):
            return   # --quiet: no progress at all, bar or line
        elif self._draws_bar():
            self._draw(item)
        else:
            log.info(item.line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _draws_bar(self) -> bool:
        if self.terminal is None:
            self.terminal = _terminal_columns() > 0
        return self.terminal

    def _draw(self, p: Progress) -> None:
        from tqdm import tqdm

        if self.bar is None:
            # Steps come in jumps of telemetry.report_every, and go back after a restart: the bar is set to each
            # report's step rather than counting, and shows raydl's own rate and eta (in `status`), not tqdm's.
            self.bar = tqdm(total=p.total or None, initial=p.step, desc="train ", unit="step", file=sys.stderr,
                            bar_format=BAR_FORMAT, dynamic_ncols=True, leave=True, postfix=p.status)
            return
        self.bar.total = p.total or None
        self.bar.n = p.step
        self.bar.set_postfix_str(p.status, refresh=False)
        self.bar.refresh()


def _terminal_columns() -> int:
    """stderr's width when it is a terminal, else 0. A terminal that reports no width (a pseudo-terminal whose
    size nobody set) gets lines too: tqdm would draw its bar in 0 columns, which shows nothing."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns if sys.stderr.isatty() else 0
    except (AttributeError, OSError, ValueError):   # no file descriptor behind sys.stderr
        return 0
