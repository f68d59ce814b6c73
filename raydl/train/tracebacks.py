"""A Ray Train worker's error tracebacks go to the run directory's workers.log, not to the console.

Ray Train logs the traceback of the error that ended a worker's train function ("Error in training
function", ray.train.v2._internal.util) on the worker's "ray.train" logger, whose console handler Ray
forwards to the driver: 30 lines once per worker in front of raydl's own one-paragraph error. Here every
ERROR record of that logger is written to <run_dir>/workers.log by the run's metrics sink (on the driver's
node, where the run directory is), and waited for, so the file is complete before the error reaches Train's
controller. Ray's console handler still gets the record unless it is about a RaydlError (whose paragraph the
driver prints, naming the file) and the verbosity is below -v; or unless the sink could not take it. What that
handler writes, Ray forwards to the driver, which puts it in the run's ray.log below -v (raydl.driver.ray_output).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from raydl import log as raydl_log
from raydl.errors import raydl_error_in

SEND_TIMEOUT_S = 30.0


class RouteToRunDir(logging.Handler):
    """Stands in for Ray's console handler on the "ray.train" logger of a worker."""

    def __init__(self, console: logging.Handler, sink_name: str, rank: int):
        super().__init__()
        self.console, self.sink_name, self.rank = console, sink_name, rank

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR:
            self.console.handle(record)
            return
        # Train logs the traceback inside its `except` block: the error is the one being handled here.
        raydl_error = raydl_error_in(sys.exc_info()[1]) is not None
        sent = self.send(record)
        if not (sent and raydl_error) or raydl_log.current_verbosity() >= raydl_log.VERBOSE:
            self.console.handle(record)

    def send(self, record: logging.LogRecord) -> bool:
        import ray

        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        text = f"--- rank {self.rank} (pid {os.getpid()}) {stamp} {record.levelname} {record.name}\n{record.getMessage()}\n"
        try:
            sink = ray.get_actor(self.sink_name)
            ray.get(sink.note_worker_log.remote(text), timeout=SEND_TIMEOUT_S)
            return True
        except (ValueError, ray.exceptions.RayError):   # the sink is gone with its node: the console keeps it
            return False


def route_worker_tracebacks(sink_name: str, rank: int) -> None:
    """Put RouteToRunDir in place of the console handler(s) that Ray Train gave this worker's "ray.train" logger."""
    from ray._private.log import PlainRayHandler

    train_logger = logging.getLogger("ray.train")
    for handler in [h for h in train_logger.handlers if isinstance(h, PlainRayHandler)]:
        train_logger.removeHandler(handler)
        train_logger.addHandler(RouteToRunDir(handler, sink_name, rank))
