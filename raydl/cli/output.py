"""stdout carries only a command's result (train: the summary JSON), also when others write to it.

Ray's processes (the raylet's and the core worker's "A worker died or was killed" lines, log lines that
Ray forwards from every worker) and the user's model code (a `print` in a constructor) write to the
process's fd 1 and to `sys.stdout`. While a result command runs, fd 1 is a copy of stderr, so all of
that goes to stderr, and so does every process started meanwhile (Ray's raylet, its workers); the
result is written to the real stdout, set aside before. fd 1 stays stderr until the process exits: Ray
forwards worker lines, and shuts down, after the command has returned. When `sys.stdout` is not the
process's own (pytest's capture, a caller's redirection), nothing is moved and the result goes to `sys.stdout`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, TextIO

_result: TextIO | None = None


def result() -> TextIO:
    """Where a command writes its result."""
    return _result or sys.stdout


@contextlib.contextmanager
def results_only() -> Iterator[None]:
    global _result
    if sys.stdout is not sys.__stdout__ or _result is not None:
        yield
        return
    sys.stdout.flush()
    _result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        yield
    finally:
        _result.flush()
