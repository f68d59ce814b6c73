"""Stopping a run on Ctrl-C or SIGTERM: a checkpoint first, then the command that resumes it.

The first signal asks the workers to stop: rank 0 asks for the request at each report without waiting
for the answer, the ranks agree on it in the report's one collective (raydl.train.agree), save a checkpoint
there and end the run; the driver then prints the checkpoint and the resume command and exits 128 + signal number
(130 for SIGINT, 143 for SIGTERM). A second signal stops at once (KeyboardInterrupt).
Under Ray the request travels through a small actor; under torchrun each rank's own
signal handler (raydl.signals.SignalStop; torchrun forwards signals to its children) records it.
"""

from __future__ import annotations

from raydl.node_actor import start_on_this_node


class StopRequest:
    """Holds the first stop signal the driver received (0 = none)."""

    def __init__(self):
        self.signum = 0

    def request(self, signum: int) -> None:
        self.signum = self.signum or signum

    def requested(self) -> int:
        return self.signum


def start_stop_request(name: str):
    """The named actor the workers ask at each report, on the driver's node, like Train's controller."""
    return start_on_this_node(StopRequest, name)
