"""The "raydl" logger: every raydl module logs to a child of it (`logging.getLogger(__name__)`).

One verbosity rules the driver and every process it starts: -1 (`--quiet`) warnings and errors only,
0 info (the default), 1 (`-v`) debug, and Ray's own INFO logs too. `configure` puts the verbosity in
RAYDL_VERBOSITY: torchrun workers inherit it, Ray workers get it through `worker_env()` in their
runtime env, and each worker entry calls `configure()` to read it back.

Lines go to stderr, so stdout carries only command results (the summary JSON, tables, a job id).
"""

from __future__ import annotations

import logging
import os
import sys

VERBOSITY_ENV = "RAYDL_VERBOSITY"
QUIET, DEFAULT, VERBOSE = -1, 0, 1
_LEVELS = {QUIET: logging.WARNING, DEFAULT: logging.INFO, VERBOSE: logging.DEBUG}
_PREFIXES = {logging.WARNING: "[raydl] warning: ", logging.ERROR: "[raydl] error: ", logging.CRITICAL: "[raydl] error: "}

logger = logging.getLogger("raydl")


class _Format(logging.Formatter):
    """Today's look: `[raydl] message`, `[raydl] warning: message`."""

    def format(self, record: logging.LogRecord) -> str:
        text = _PREFIXES.get(record.levelno, "[raydl] ") + record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each line: pytest and Ray's workers replace it after start-up."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _ignored) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        """Above a progress bar, if one is drawn (raydl.console): tqdm clears it, the line goes out, the bar
        is redrawn below it. tqdm is looked up, not imported: without a bar there is nothing to clear."""
        tqdm = sys.modules.get("tqdm")
        if tqdm is None or not tqdm.tqdm._instances:
            super().emit(record)
            return
        with tqdm.tqdm.external_write_mode(file=self.stream):
            super().emit(record)


def configure(verbosity: int | None = None) -> int:
    """Set the "raydl" logger up for `verbosity` (None: RAYDL_VERBOSITY, else the default); returns it."""
    if verbosity is None:
        verbosity = current_verbosity()
    verbosity = max(QUIET, min(VERBOSE, verbosity))
    os.environ[VERBOSITY_ENV] = str(verbosity)
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Format())
    logger.addHandler(handler)
    logger.setLevel(_LEVELS[verbosity])
    # Ray installs handlers on the root logger: propagating would print every line twice.
    logger.propagate = False
    quiet_libraries(verbosity)
    return verbosity


# What libraries log at import that no raydl user acts on, shown with -v only: torchao (imported by transformers'
# quantizers whenever it is installed, for train.precision=fp8) warns for each CUDA kernel library a CPU build cannot
# load, and torch's pytree warns that torchao registers its enums the deprecated way.
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def quiet_libraries(verbosity: int) -> None:
    for name in _IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.NOTSET if verbosity >= VERBOSE else logging.ERROR)


def ensure_configured() -> None:
    """For entries that the CLI may not have run first (the Python API): configure from the env once."""
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        configure()


def current_verbosity() -> int:
    try:
        return int(os.environ.get(VERBOSITY_ENV, str(DEFAULT)))
    except ValueError:   # a stray value in the environment is not worth failing a run for
        return DEFAULT


def worker_env() -> dict[str, str]:
    """The env var a Ray worker's runtime env needs to log at this process's verbosity."""
    return {VERBOSITY_ENV: str(current_verbosity())}


def quiet_exits_in_callbacks() -> None:
    """Stop Python printing a SystemExit that it ignores, as it ignores any exception of a weakref callback
    or finalizer. Ray ends a worker with SIGTERM (Tune, when it frees the placement group of a trial whose
    actor it has stopped), and Ray's handler raises SystemExit wherever the main thread is: inside such a
    callback Python printed "Exception ignored in ..." and its traceback to the sweep's console. Other
    ignored errors are still printed; the process still ends (Ray follows up with SIGKILL)."""
    if getattr(sys.unraisablehook, "raydl_quiet_exits", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not issubclass(unraisable.exc_type, SystemExit):
            previous(unraisable)

    hook.raydl_quiet_exits = True
    sys.unraisablehook = hook


def ray_log_level() -> int:
    """Ray's own loggers: INFO only when verbose; its INFO lines (every report's metrics) are noise otherwise."""
    return logging.INFO if current_verbosity() >= VERBOSE else logging.WARNING
