"""debug.hold_at_step: every rank waits after a step's report until the test that asked releases it.

A fault test changes the cluster (adds a node, drains one) while the run trains. Without a hold, whether the change
lands before the run ends depends on how fast this machine trains and how soon Ray sees the change; held at a known
step (its checkpoint registered), the run meets the change there, however slow the machine, and the test needs no
more steps than the change takes. The ranks wait in sleep (no CPU). A resize replaces the held group; a drain notice
ends the hold so that the notice's checkpoint comes at the next report; otherwise the test writes the release file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from raydl.config import DebugSection

POLL_S = 0.1


def hold_after(step: int, debug: DebugSection, notice) -> None:
    """At debug.hold_at_step: mark this rank held, then wait for <ledger_dir>/release or `notice()` (a drain notice)."""
    if step != debug.hold_at_step:
        return
    Path(debug.ledger_dir, f"held-{os.getpid()}").touch()
    release = Path(debug.ledger_dir, "release")
    while not release.exists() and not notice():
        time.sleep(POLL_S)
