"""What Ray prints on the driver's console goes to the run's ray.log instead: raydl alone speaks there.

Ray's driver prints lines that it did not write itself. With `log_to_driver` (on by default, and on in a
cluster's ray.init that raydl did not make) it forwards what every worker and actor writes to stdout and
stderr: Train's controller ("Graceful shutdown of backend failed" and its traceback), a worker's traceback,
MLflow's "View run" lines and W&B's from the metrics sink, a model's prints; each with a "(RayTrainWorker
pid=...)" prefix in colour. And it prints the raylet's error messages ("A worker died or was killed ...", a
paragraph). Both pass through `print_to_stdstream` in ray._private.worker: the forwarded lines through the
handler that ray.init registers under "ray_print_logs" with Ray's stdstream dispatcher, the raylet's
through a direct call of the module's function (`listen_error_messages`). Ray has no setting for where
they go (log_to_driver=False drops the forwarded ones, and the raylet's are printed regardless), so while a
run trains `RouteToFile` takes both places. After the run, on a Ray the caller started, Ray prints again (`AfterRun`),
except what the run's own actors still write (Train's placement-group cleaner noticing that the controller is gone,
a worker shutting down): those lines are the run's, and go on to its file.

A line that raydl's logger wrote in a worker or actor ("[raydl] ...") is shown on the console as raydl's
own, without Ray's prefix; every other line is appended to the log file with Ray's prefix and no colour.
What a user needs of them is raydl's line (the metrics sink's "a worker failed: rank 1 ... died",
"logging to MLflow run ..."). With -v Ray prints as it does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raydl import log as raydl_log

log = logging.getLogger("raydl")

RAY_LOG = "ray.log"   # beside workers.log in the run directory (a sweep: in the sweep directory)
HANDLER = "ray_print_logs"   # the name ray.init registers Ray's printing under (ray._private.worker.connect)
_LEVELS = {"[raydl] warning: ": logging.WARNING, "[raydl] error: ": logging.ERROR, "[raydl] ": logging.INFO}
# The actors a run starts (Ray Train's, raydl's), as Ray names them in a
# forwarded line's prefix.
RUN_ACTORS = frozenset({"TrainController", "RayTrainWorker", "PlacementGroupCleaner", "PreemptionWatcher",
                        "SynchronizationActor", "MetricsSink"})


def raydl_line(line: str) -> tuple[int, str] | None:
    """(level, message) of a line that raydl's logger formatted (raydl.log), else None."""
    for prefix, level in _LEVELS.items():
        if line.startswith(prefix):
            return level, line[len(prefix):]
    return None


def ray_prefix(data: dict[str, Any]) -> str:
    """Ray's prefix of a batch of lines, as Ray writes it without colour: "(RayTrainWorker pid=42, ip=...) "."""
    pid = data.get("pid")
    if pid in ("raylet", "autoscaler"):
        return f"({pid}) "
    name = data.get("actor_name") or data.get("task_name")
    ip = data.get("ip")
    where = f", ip={ip}" if ip and ip != data.get("localhost") else ""
    return f"({name + ' ' if name else ''}pid={pid}{where}) "


def _printed_lines(data: dict[str, Any]) -> list[str]:
    """The lines Ray would print of a batch: of the autoscaler's log, only its events (Ray's own filter); not
    the state of a worker's progress bar (ray.experimental.tqdm_ray), which Ray draws rather than prints."""
    from ray._private.worker import filter_autoscaler_events
    from ray.experimental.tqdm_ray import RAY_TQDM_MAGIC

    lines = data.get("lines", [])
    if data.get("pid") == "autoscaler":
        lines = filter_autoscaler_events(lines)
    return [line for line in lines if RAY_TQDM_MAGIC not in line]


class RouteToFile:
    """Stands in for Ray's `print_to_stdstream` on the driver while it is installed (`route_to`)."""

    def __init__(self, path: Path, fallback):
        """fallback: Ray's own printer, for lines the file cannot take (its run directory was removed)."""
        self.path, self.fallback, self.lock = path, fallback, threading.Lock()

    def __call__(self, data: dict[str, Any], ignore_prefix: bool = False) -> None:
        kept = []
        for line in _printed_lines(data):
            ours = raydl_line(line)
            if ours:
                log.log(*ours)
            else:
                kept.append(line)
        if not kept:
            return
        prefix = ray_prefix(data)
        try:
            with self.lock, self.path.open("a") as f:
                f.writelines(f"{prefix}{line}\n" for line in kept)
        except OSError:
            self.fallback({**data, "lines": kept}, ignore_prefix)


class AfterRun:
    """Stands in for Ray's printer after a run on a Ray the caller started: the run's actors' lines go on to the
    run's file, everything else is Ray's to print again."""

    def __init__(self, route: RouteToFile, rays):
        self.route, self.rays = route, rays

    def __call__(self, data: dict[str, Any], ignore_prefix: bool = False) -> None:
        printer = self.route if data.get("actor_name") in RUN_ACTORS else self.rays
        printer(data, ignore_prefix)


@contextlib.contextmanager
def route_to(path: Path, *, keep_after: bool = False) -> Iterator[None]:
    """While inside, Ray's printed lines go to `path` (see the module's doc); with -v nothing changes.
    keep_after: leave them routed after the block (raydl started this Ray: the lines of its shutdown, which
    come after the run's end, are the run's too); otherwise Ray prints again, but for the run's actors (AfterRun)."""
    import ray._private.worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    if raydl_log.current_verbosity() >= raydl_log.VERBOSE:
        yield
        return
    original = ray_worker.print_to_stdstream
    # After an earlier run in this process Ray's printer is its AfterRun: replaced below, not wrapped in another.
    rays = original.rays if isinstance(original, AfterRun) else original
    route = RouteToFile(path, rays)
    forwarding = any(name == HANDLER for name, _ in dispatcher.handlers)
    ignore_prefix = ray_worker._should_ignore_worker_log_prefix(ray_worker.global_worker)
    _install(ray_worker, dispatcher, route, forwarding, ignore_prefix)
    try:
        yield
    finally:
        if not keep_after:
            _install(ray_worker, dispatcher, AfterRun(route, rays), forwarding, ignore_prefix)


def _install(ray_worker, dispatcher, printer, forwarding: bool, ignore_prefix: bool) -> None:
    ray_worker.print_to_stdstream = printer   # the raylet's messages: listen_error_messages calls it by name
    if forwarding:   # the forwarded lines: only where ray.init asked for them (log_to_driver)
        dispatcher.remove_handler(HANDLER)
        dispatcher.add_handler(HANDLER, functools.partial(printer, ignore_prefix=ignore_prefix))
