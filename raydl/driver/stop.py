"""Stopping a run on Ctrl-C or SIGTERM: a checkpoint first, then the command that resumes it.

The first signal asks the workers to stop: they see the request at their next report (a
barrier they all reach at the same step), save a checkpoint there and end the run; the
driver then prints the checkpoint and the resume command and exits 128 + signal number
(130 for SIGINT, 143 for SIGTERM). A second signal stops at once (KeyboardInterrupt).
Under Ray the request travels through a small actor; under torchrun each rank's own
signal handler (torchrun forwards signals to its children) records it.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Holds the first stop signal the driver received (0 = none)."""

    def __init__(self):
        self.signum = 0

    def request(self, signum: int) -> None:
        self.signum = self.signum or signum

    def requested(self) -> int:
        return self.signum


def start_stop_request(name: str):
    """The named actor the workers ask at each report (imported lazily: torchrun runs without Ray). It lives
    on the driver's node, like Train's controller, so losing a worker node never takes it along."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(StopRequest).options(name=name, scheduling_strategy=here).remote()


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
