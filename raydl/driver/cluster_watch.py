"""Say that the cluster is gone before Ray ends this process without a word.

When the node this driver runs on loses its raylet (a joined cluster's head stopped, with the driver on
it), Ray's core worker terminates the process as soon as it next touches the object store ("The
connection to the plasma store is failed. Terminate the process.": exit 1, nothing on the console).
Whether raydl's own handler for the Train controller's death (`ray_trainer.fit`) runs first is a race.
This watch polls the local raylet's port; once it stops answering, the run cannot go on in this
process, so the watch prints raydl's one-paragraph error (the checkpoint and the resume command) and
exits with the same code, 1.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Callable

POLL_S = 0.1   # a race with the core worker's own exit (see above): a local TCP connect costs ~0.1 ms
PROBE_TIMEOUT_S = 1.0


def raylet_answers(node: dict, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the raylet of `node` (a ray.nodes() entry) accepts a TCP connection now: a vanished node's
    port refuses or times out at once, while the GCS may list it alive for another 16 s."""
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s):
            return True
    except OSError:
        return False


class LocalRayletWatch:
    def __init__(self, message: Callable[[], str], exit_code: int):
        self.message, self.exit_code = message, exit_code
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="raydl-raylet-watch")

    def __enter__(self) -> "LocalRayletWatch":
        import ray

        here = ray.get_runtime_context().get_node_id()
        self.node = next(node for node in ray.nodes() if node["NodeID"] == here)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _watch(self) -> None:
        self.message()   # once now: whatever it imports is loaded before the race it is for
        while not self._stop.wait(POLL_S):
            if not raylet_answers(self.node):
                print(f"raydl: error: {self.message()}", file=sys.stderr, flush=True)
                os._exit(self.exit_code)
