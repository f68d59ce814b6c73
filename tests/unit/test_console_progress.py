"""raydl.console: a bar on a terminal, the progress line elsewhere, nothing with --quiet; raydl's other
lines go above the bar."""

from __future__ import annotations

import pytest

from raydl import log as raydl_log
from raydl.console import Console, Progress

STATUS = "loss 0.4061 lr 3.00e-04 1630 samples/s data-wait 0.0% ws 2 0.0118 core-h eta 0s"


class Stderr:
    def __init__(self, capsys):
        self.capsys = capsys

    def getvalue(self) -> str:
        return self.capsys.readouterr().err


@pytest.fixture
def stderr(capsys):
    """What the test wrote to stderr (pytest's capture: no terminal)."""
    raydl_log.configure(raydl_log.DEFAULT)
    yield Stderr(capsys)
    raydl_log.configure(raydl_log.DEFAULT)


def test_without_a_terminal_progress_is_a_line(stderr):
    console = Console()   # pytest's captured stderr is no terminal
    console.show(Progress(10, 500, STATUS))
    console.close()
    assert stderr.getvalue() == f"[raydl] step 10/500 {STATUS}\n"


def test_on_a_terminal_progress_is_one_bar_with_lines_above_it(stderr):
    console = Console(terminal=True)
    console.show(Progress(10, 500, STATUS))
    console.show("a warning between two reports")
    console.show(Progress(500, 500, STATUS))
    console.close()
    out = stderr.getvalue()
    assert "[raydl] step" not in out
    assert "train   2%|" in out and " 10/500 " in out and "train 100%|" in out and " 500/500 " in out, out
    assert out.count(STATUS) >= 2 and out.endswith("\n")
    screen = out.split("\r")   # what stays: each redraw starts at the line's beginning
    assert any(part.startswith("[raydl] a warning between two reports\n") for part in screen), out


def test_a_restart_moves_the_bar_back(stderr):
    console = Console(terminal=True)
    console.show(Progress(40, 100, STATUS))
    console.show(Progress(30, 100, STATUS))   # the group restarted from its step-30 checkpoint
    assert console.bar.n == 30
    console.close()
    assert console.bar is None


def test_quiet_shows_no_progress(stderr):
    raydl_log.configure(raydl_log.QUIET)
    for terminal in (True, False):
        console = Console(terminal=terminal)
        console.show(Progress(10, 500, STATUS))
        console.close()
    assert stderr.getvalue() == ""
