"""Ctrl-C and SIGTERM in a raydl process: the first asks for a stop with a checkpoint, the second stops at once.

Used by the driver (which passes the request on to the workers through the run's metrics sink,
raydl.metrics.sink.MetricsSink.request_stop) and by every torchrun rank. The driver then prints the checkpoint and
the command that resumes the run, and exits 128 + signal number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalStop:
    """First signal: record it (and call `on_first`); second: stop at once. A no-op off the main thread."""

    def __init__(self, on_first=lambda signum: None):
        self.signum, self.on_first, self.previous = 0, on_first, {}

    def __enter__(self) -> "SignalStop":
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning(f"{signal.Signals(signum).name}: stopping at the next report with a checkpoint; "
                    f"send it again to stop at once")
        self.on_first(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
