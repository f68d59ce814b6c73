"""`kill -USR1` of a raydl command prints every thread's stack on its stderr, and the command goes on."""

from __future__ import annotations

import subprocess
import sys

import pytest

ASKED_MID_COMMAND = """
import os, signal, sys
from raydl import cli
from raydl.cli import config
def show_and_ask(args):
    os.kill(os.getpid(), signal.SIGUSR1)   # as `kill -USR1 PID` while the command runs
    print("went on")
config.run_show = show_and_ask
cli.main(["config", "show"])
"""


@pytest.mark.slow   # a child process
def test_sigusr1_prints_the_stacks_and_the_command_goes_on():
    p = subprocess.run([sys.executable, "-c", ASKED_MID_COMMAND], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "went on\n", p
    assert "most recent call first" in p.stderr and "show_and_ask" in p.stderr, p.stderr
