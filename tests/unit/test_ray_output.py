"""raydl.driver.ray_output: Ray's printed lines go to the run's ray.log, raydl's own lines from workers stay on the
console, and Ray's printing comes back after the run (unless raydl started that Ray) and with -v is never taken.
Without a Ray cluster: the batches are the dicts Ray's driver hands its printer (ray._private.worker)."""

from __future__ import annotations

import functools
import logging

import pytest
import ray._private.worker as ray_worker
from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

from raydl import log as raydl_log
from raydl.driver.ray_output import HANDLER, RouteToFile, ray_prefix, raydl_line, route_to

DIED = ("A worker died or was killed while executing a task by an unexpected system error. Worker PID: 4242 "
        "Worker exit type: SYSTEM_ERROR")


@pytest.fixture
def default_verbosity():
    previous = raydl_log.current_verbosity()
    raydl_log.configure(raydl_log.DEFAULT)
    yield
    raydl_log.configure(previous)


def test_raydl_lines_are_told_from_ray_lines():
    assert raydl_line("[raydl] warning: data.path is slow") == (logging.WARNING, "data.path is slow")
    assert raydl_line("[raydl] step 10/20 loss 2.1") == (logging.INFO, "step 10/20 loss 2.1")
    assert raydl_line("[raydl] error: boom") == (logging.ERROR, "boom")
    assert raydl_line("Traceback (most recent call last):") is None
    assert raydl_line("  [raydl] indented") is None


def test_prefix_is_rays_without_colour():
    assert ray_prefix({"pid": 42, "actor_name": "RayTrainWorker", "ip": "10.0.0.5", "localhost": "10.0.0.5"}) == \
        "(RayTrainWorker pid=42) "
    assert ray_prefix({"pid": 7, "task_name": "read", "ip": "10.0.0.6", "localhost": "10.0.0.5"}) == \
        "(read pid=7, ip=10.0.0.6) "
    assert ray_prefix({"pid": "raylet"}) == "(raylet) "


def test_ray_lines_go_to_the_file_and_raydl_lines_to_the_console(tmp_path, default_verbosity, capsys):
    fallback_calls = []
    route = RouteToFile(tmp_path / "ray.log", lambda data, ignore_prefix: fallback_calls.append(data))
    route({"pid": 42, "actor_name": "TrainController", "is_err": True,
           "lines": ["Graceful shutdown of backend failed.", "[raydl] warning: slow disk", "Traceback (most recent"]})
    route({"pid": "raylet", "is_err": False, "lines": [DIED]})
    route({"pid": 43, "is_err": False, "lines": ['{"__ray_tqdm_magic_token__": true, "x": 1}']})   # a bar's state
    assert capsys.readouterr().err == "[raydl] warning: slow disk\n"
    assert (tmp_path / "ray.log").read_text().splitlines() == [
        "(TrainController pid=42) Graceful shutdown of backend failed.", "(TrainController pid=42) Traceback (most recent",
        f"(raylet) {DIED}"]
    assert not fallback_calls
    gone = RouteToFile(tmp_path / "removed" / "ray.log", lambda data, ignore_prefix: fallback_calls.append(data))
    gone({"pid": 1, "lines": ["late line"]})     # its run directory was removed: Ray prints it, nothing is lost
    assert fallback_calls == [{"pid": 1, "lines": ["late line"]}]


@pytest.fixture
def forwarding():
    """Ray's printer registered with the dispatcher as ray.init(log_to_driver=True) does, in place of the one a Ray
    of this test process registered (ray_session's); Ray's printing as it was put back after."""
    printer, registered = ray_worker.print_to_stdstream, [pair for pair in dispatcher.handlers if pair[0] == HANDLER]
    dispatcher.remove_handler(HANDLER)
    dispatcher.add_handler(HANDLER, functools.partial(printer, ignore_prefix=False))
    yield
    dispatcher.remove_handler(HANDLER)
    ray_worker.print_to_stdstream = printer
    for pair in registered:
        dispatcher.add_handler(*pair)


def printers() -> tuple:
    """(the raylet messages' printer, the forwarded lines' printer) as Ray's driver finds them now."""
    [handler] = [h for name, h in dispatcher.handlers if name == HANDLER]
    return ray_worker.print_to_stdstream, handler.func


def test_route_is_taken_for_the_run_and_given_back_but_for_the_runs_actors(tmp_path, default_verbosity, forwarding,
                                                                             capsys):
    with route_to(tmp_path / "ray.log"):
        taken = printers()
        assert all(isinstance(p, RouteToFile) for p in taken)
        ray_worker.print_to_stdstream({"pid": "raylet", "is_err": False, "lines": [DIED]}, ignore_prefix=False)
    assert DIED in (tmp_path / "ray.log").read_text()
    # After the run (a Ray the caller started): Train's cleaner, still checking on the controller, is the run's; the
    # caller's own actor and the raylet are Ray's to print again.
    raylet, forwarded = printers()
    late = "Failed to query Ray Train Controller actor state. Continuing to monitor."
    forwarded({"pid": 7, "actor_name": "PlacementGroupCleaner", "is_err": True, "lines": [late]})
    forwarded({"pid": 8, "actor_name": "CallersActor", "is_err": False, "lines": ["the caller's own line"]})
    raylet({"pid": "raylet", "is_err": True, "lines": ["a raylet message after the run"]})
    printed = capsys.readouterr()
    assert late in (tmp_path / "ray.log").read_text() and late not in printed.out + printed.err
    assert "the caller's own line" in printed.out and "a raylet message after the run" in printed.err
    assert "the caller's own line" not in (tmp_path / "ray.log").read_text()
    with route_to(tmp_path / "ray.log", keep_after=True):   # raydl started this Ray: its shutdown's lines too
        pass
    assert all(isinstance(p, RouteToFile) for p in printers())


def test_verbose_leaves_rays_printing_alone(tmp_path, forwarding):
    rays = printers()
    previous = raydl_log.current_verbosity()
    raydl_log.configure(raydl_log.VERBOSE)
    try:
        with route_to(tmp_path / "ray.log", keep_after=True):
            assert printers() == rays
    finally:
        raydl_log.configure(previous)


def test_a_dead_worker_is_named_by_rank_pid_and_node_before_the_errors_it_caused():
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from raydl.driver.callbacks import dead_worker, failure_cause

    died = RayActorError(error_msg="The actor died unexpectedly before finishing this task.\n\tpid: 4242\n\t"
                                   "ip: 10.0.0.5\nThe actor is dead because its worker process has died. Worker exit "
                                   "type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
                                   "error code 2. End of file.")
    wrapped = WorkerHealthCheckFailedError("health check failed", died)
    assert dead_worker(wrapped) is died and dead_worker(RuntimeError("gloo: connection reset")) is None
    assert failure_cause(1, wrapped) == ("rank 1 (pid 4242) on node 10.0.0.5 died (its process ended without a "
                                         "Python error: a signal such as SIGKILL, the OOM killer, or a crash)")
    assert failure_cause(0, RuntimeError("gloo: connection reset\nmore")) == "rank 0: RuntimeError: gloo: connection reset"
