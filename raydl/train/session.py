"""Where a worker runs: under Ray Train or under torchrun. The loop only sees this interface.

Ray: ranks and the process group come from Ray Train; rank 0 sends step records to the run's
metrics sink actor without waiting (raydl.metrics.sink); each rank writes its checkpoint shards
to a local temp dir and `ray.train.report` uploads and registers them (all ranks must report: it
is a barrier, and the controller drains one report per poll, so only checkpoints go through it).
torchrun: ranks come from the environment, raydl creates the process group, checkpoints are
written straight into the shared run directory and the rank-0 process writes metrics itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from raydl import log as raydl_log
from raydl import storage
from raydl.console import Console
from raydl.metrics import run_mirror
from raydl.metrics.writer import MetricsWriter
from raydl.signals import SignalStop
from raydl.telemetry.records import WorkerReport
from raydl.telemetry.startup import process_start_time
from raydl.train import checkpoint as ckpt
from raydl.train.tracebacks import SEND_TIMEOUT_S, route_worker_tracebacks

log = logging.getLogger(__name__)
# How long the leader waits for Ray's registry before it tidies up (RaySession._remove_unregistered): well inside
# the survivors' 30 s collective timeout, which the others spend waiting for it in the next step.
REGISTRY_WAIT_S = 5.0


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class RaySession:
    def __init__(self, sink_name: str, *, tune_reports: bool = False, survivors: bool = False,
                 checkpoints_at: str = "", keep: int = 1):
        """`sink_name`: the run's metrics sink actor. `tune_reports`: also send every report through Ray Train
        (a multi-worker sweep trial: Tune sees a trial's progress only in its Train reports). `survivors`: the
        survivors path (raydl.train.survivors), where any worker may be the one that sends the records, and the
        leading replica writes the checkpoints alone while the group is smaller, `keep` of them, to the run's
        checkpoint location `checkpoints_at`."""
        import ray
        import ray.train

        self._train = ray.train
        # Ray echoes every report's full metrics (raydl's step records) at INFO; raydl prints its own progress.
        # (that module names its logger by __file__).
        from ray.train.v2._internal.execution import context as ray_context

        logging.getLogger(ray_context.__file__).setLevel(raydl_log.ray_log_level())
        ctx = ray.train.get_context()
        self.world_size, self.rank = ctx.get_world_size(), ctx.get_world_rank()
        self.local_rank = ctx.get_local_rank()
        self.device = pick_device(self.local_rank)
        self.registered: set[str] = set()   # checkpoint dir names registered before this worker group started
        self.alone: list[str] = []   # checkpoints written alone, newer than Ray's newest (survivors), newest first
        self.last_reported: str | None = None   # the name of this group's newest checkpoint reported through Ray
        self.unconfirmed: list[str] = []   # ones reported through Ray just before a loss, which Ray may never register
        self.checkpoints_at, self.keep = checkpoints_at, max(keep, 1)
        self.sink = ray.get_actor(sink_name) if self.rank == 0 or survivors else None
        route_worker_tracebacks(sink_name, self.rank)
        self.leader = self.rank == 0        # sends the records (the loop moves it on the survivors path)
        self.tune_reports, self.survivors = tune_reports, survivors
        self._stop_actor = None             # the driver's stop request, looked up at the first report
        self._stop_answer = None            # rank 0's question to it, in flight

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[str | None]:
        """The newest checkpoint that verifies (a corrupt newest one falls back to the previous): Ray's registered
        ones and, on the survivors path, the newer ones its leading replica wrote alone while the group was smaller
        (Ray's registry never saw those, as the run's end and `raydl train --resume` do)."""
        reports = self._train.get_all_reported_checkpoints() if self._train.get_checkpoint() is not None else []
        reported = [r.checkpoint for r in reports]
        self.registered = _names(reports)
        if self.survivors and self.checkpoints_at:
            listed = ckpt.all_complete(self.checkpoints_at)
            self.alone = [str(c) for c in ckpt.newer_than_registered(listed, self.registered, _newest_step(reports))]
        if not reported and not self.alone:
            yield None
            return
        with contextlib.ExitStack() as stack:
            dirs = [stack.enter_context(c.as_directory()) for c in reversed(reported)]
            yield ckpt.agree_on_first_valid(self.alone + dirs)

    def newest_checkpoint_step(self) -> int | None:
        """The step of the newest checkpoint Ray registered for this run (from its metrics: no storage read)."""
        return _newest_step(self._train.get_all_reported_checkpoints())

    def controller_start(self) -> float | None:
        """When the Train controller's process started (a start-up mark), asked of the controller."""
        import ray
        from ray.train.v2._internal.execution.context import get_train_context

        controller = get_train_context().controller_actor
        return ray.get(controller.__ray_call__.remote(lambda _: process_start_time()), timeout=30)

    def preemption_notice(self) -> bool:
        """True once Train's preemption watcher told this worker that a node of its group will be drained
        (read locally: the ranks agree on it in raydl.train.agree)."""
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info is not None

    def stop_signal(self, actor_name: str | None, *, asks: bool) -> int:
        """The signal the driver got (0 = none, or not known yet), asked without waiting by the one worker that
        `asks` (rank 0; on the survivors path the first live replica, as rank 0 may be the worker lost): the
        answer to the previous question if it has come, and the next question sent. The report's collective
        tells the others."""
        import ray

        if not asks or not actor_name:
            return 0
        try:
            self._stop_actor = self._stop_actor or ray.get_actor(actor_name)   # one name lookup per group
            answer = self._stop_answer
            if answer is not None and not ray.wait([answer], timeout=0)[0]:
                return 0   # still on its way
            self._stop_answer = self._stop_actor.stop_requested.remote()
            return ray.get(answer) if answer is not None else 0
        except (ValueError, ray.exceptions.RayError):   # gone with the driver: nobody can ask to stop
            return 0

    def wait_for_restart(self) -> None:
        """After the checkpoint at a preemption notice: stop stepping until Ray replaces this worker group.

        Ray restarts the group at the drain deadline anyway, and resumes from that checkpoint, so further
        steps would only be redone. Worse, when the preempted node goes away mid-collective, the survivors
        fail with a connection error, and if Ray polls that error before the preempted rank's death it
        counts as an ordinary failure (against max_failures) instead of a preemption."""
        while True:
            time.sleep(1.0)

    def save_and_report(self, step: int, report: WorkerReport, save_fn) -> None:
        from ray.train import Checkpoint

        self._send(report)
        d, name = tempfile.mkdtemp(prefix="raydl-ckpt-"), self._unused_name(step)
        try:
            save_fn(d)
            self._train.report(report.to_dict() if self.tune_reports else report.registered_metrics(),
                               checkpoint=Checkpoint.from_directory(d), checkpoint_dir_name=name)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        self.last_reported = name
        if self.leader:   # Ray's newest now: the ones written alone before it are older (its retention skips them)
            for old in self.alone:
                ckpt.remove(old)
            self.alone = []
            self._remove_unregistered(name)

    def _remove_unregistered(self, newest: str) -> None:
        """Delete the checkpoints reported through Ray just before a loss that Ray never registered.

        Ray uploads a report's checkpoint before it has every worker's report; when it replaces a lost worker it
        discards the survivors' pending reports, so that upload stays in storage, complete, outside Ray's retention.
        Whether Ray registered it is known only once it has registered a newer one (`newest`, just reported):
        it registers in report order."""
        if not self.unconfirmed:
            return
        kept = _names(self._train.get_all_reported_checkpoints(timeout_s=REGISTRY_WAIT_S))
        if newest not in kept:
            return   # not registered yet (a slow controller): ask again at the next checkpoint
        for name in self.unconfirmed:
            if name not in kept:   # never registered, or registered and since deleted by Ray's retention
                ckpt.remove(storage.join(self.checkpoints_at, name))
        self.unconfirmed = []

    def save_alone(self, step: int, report: WorkerReport, save_fn) -> None:
        """The survivors path's checkpoint while a replacement is still missing. Ray's report is a barrier of every
        worker, which the missing one would never reach; the leader is a whole replica (its process group is
        itself), so it writes the checkpoint straight to the run's checkpoint location, state file last, where the
        run's summary, a restart of the group and `raydl train --resume` find it, and keeps `keep` of these."""
        if self.last_reported:   # the group's last report through Ray, maybe never registered (_remove_unregistered)
            self.unconfirmed.append(self.last_reported)
            self.last_reported = None
        d = tempfile.mkdtemp(prefix="raydl-ckpt-")
        try:
            save_fn(d)
            target = storage.join(self.checkpoints_at, ckpt.checkpoint_name(step))
            ckpt.upload_shards(d, target, rank=0)
            ckpt.upload_last(d, target)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        self.alone.insert(0, target)
        for old in self.alone[self.keep:]:
            ckpt.remove(old)
        del self.alone[self.keep:]
        self._send(report)   # after the checkpoint: the run's summary (and its end) follows this report

    def _unused_name(self, step: int) -> str:
        """step_N, or step_N.2, .3, ... when step N is redone after a fallback past a corrupt checkpoint N.

        Ray deletes an evicted checkpoint by its path: a second registered step_N would have its files
        deleted with the first, and the second deletion fails the run (FileNotFoundError in the controller).
        The names sort newest first, as `checkpoint.all_complete` expects."""
        name, n = ckpt.checkpoint_name(step), 1
        taken = self.registered | {ckpt.dir_name(a) for a in self.alone}
        while (candidate := name if n == 1 else f"{name}.{n}") in taken:
            n += 1
        return candidate

    def report(self, report: WorkerReport, *, whole: bool = True) -> None:
        """Records to the sink. Through Ray Train too for a sweep trial, and at a worker group's first report:
        Train's guard actors start there (raydl.driver.late_start), which a run that checkpoints every 100 steps
        would otherwise leave unguarded until its first checkpoint, and would start mid-run, their imports taking
        CPU from the steps. `whole`: every worker of the group is there to report (Ray's report is a barrier of
        all of them; on the survivors path a worker lost before it would never reach it, nor would its
        replacement, whose first report is no group start)."""
        self._send(report)
        if self.tune_reports or (report.group_start and whole):
            self._train.report(report.to_dict() if self.tune_reports else report.registered_metrics())

    def announce(self, line: str) -> None:
        """A console line of rank 0's (the layout), printed by the driver with the run's progress."""
        self.sink.say.remote(line)

    def _send(self, report: WorkerReport) -> None:
        """Rank 0's records to the sink, not waited for; the run's final report is, so summary.json is
        written before the train function returns."""
        if self.sink is None or not self.leader:
            return
        import ray

        written = self.sink.write.remote(report, self.world_size)
        if report.final:
            ray.get(written, timeout=60)

    def failed(self, error: Exception) -> None:
        """On the survivors path: this worker's train function is ending with `error`. The sink keeps it, waited
        for, before Ray's controller can see it: the controller may be waiting to place another worker's
        replacement, blind to this one until a node comes, and then the driver ends the run with this error
        (raydl.driver.finished_watch)."""
        import pickle
        import traceback

        import ray

        text = "".join(traceback.format_exception(error))
        try:
            sent = self.sink.note_worker_error.remote(self.rank, error, text)
        except (TypeError, pickle.PicklingError):   # an error that cannot travel: its text can
            sent = self.sink.note_worker_error.remote(self.rank, RuntimeError(f"{type(error).__name__}: {error}"), text)
        try:
            ray.get(sent, timeout=SEND_TIMEOUT_S)
        except ray.exceptions.RayError:   # the sink is gone with the driver's node: so is the run
            pass

    def close(self) -> None:
        pass


class TorchrunSession:
    def __init__(self, run_dir: str, keep: int, progress: bool, events_dir: str | None = None,
                 trackers: dict | None = None, *, storage_path: str = "", run_id: str | None = None):
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = pick_device(self.local_rank)
        # A caller's group is the caller's to close; a lone process started without torchrun needs none.
        self.owns_group = not dist.is_initialized() and "RANK" in os.environ
        if self.owns_group:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.run_dir, self.keep = Path(run_dir), keep
        # The run directory's train/, or storage_path/<run>-<run id> (a bucket): as under Ray Train. Only rank 0
        # of a new run knows the run id it wrote.
        self.checkpoints_at = storage.join(*storage.run_checkpoints(storage_path, run_dir, _from_rank0(run_id)))
        self.console = Console()   # rank 0's progress: a bar when its stderr is a terminal
        self.writer = (MetricsWriter(self.run_dir, progress=progress, events_dir=events_dir, trackers=trackers,
                                     say=self.console.show, mirror=run_mirror.location(self.checkpoints_at))
                       if self.rank == 0 else None)
        self.signals = SignalStop().__enter__()   # torchrun forwards SIGINT/SIGTERM to every rank

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[str | None]:
        yield ckpt.agree_on_first_valid([str(c) for c in ckpt.all_complete(self.checkpoints_at)])

    def controller_start(self) -> float | None:
        return None   # no controller: torchrun starts the ranks itself

    def preemption_notice(self) -> bool:
        return False   # torchrun has no drain notices; its restarts resume from the run directory

    def stop_signal(self, actor_name: str | None, *, asks: bool) -> int:
        return self.signals.signum   # torchrun forwards the signal to every rank's own handler

    def announce(self, line: str) -> None:
        self.console.show(line)

    def save_and_report(self, step: int, report: WorkerReport, save_fn) -> None:
        name = ckpt.checkpoint_name(step)
        local = self.run_dir / "train" / name
        save_fn(str(local))
        _barrier()
        path = str(local)
        if storage.is_uri(self.checkpoints_at):
            path = storage.join(self.checkpoints_at, name)
            self._upload(local, path)
        if self.rank == 0:
            for old in ckpt.all_complete(self.checkpoints_at)[self.keep:]:
                ckpt.remove(old)
        self.report(report, checkpoint=path)

    def _upload(self, local: Path, path: str) -> None:
        """Every rank's shards, then rank 0's two last files; then the local copy goes (on every node)."""
        ckpt.upload_shards(local, path, rank=self.rank)
        _barrier()
        if self.rank == 0:
            ckpt.upload_last(local, path)
        _barrier()
        shutil.rmtree(local, ignore_errors=True)

    def report(self, report: WorkerReport, checkpoint: str | None = None, *, whole: bool = True) -> None:
        """Records to metrics.jsonl (`whole`, whether every worker reports, matters only to Ray's report)."""
        if self.writer:
            self.writer.write(report, world_size=self.world_size, checkpoint=checkpoint)

    def close(self) -> None:
        self.console.close()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _names(reports) -> set[str]:
    """The directory names of Ray's reported checkpoints."""
    return {ckpt.dir_name(r.checkpoint.path) for r in reports}


def _newest_step(reports) -> int | None:
    """The step of the newest of Ray's reported checkpoints, from their metrics."""
    return max((r.metrics.get("step", -1) for r in reports), default=None)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(value: str | None) -> str | None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def in_ray() -> bool:
    """In a Ray Train worker. Ray's worker processes import ray.train before they run the train function; a torchrun
    rank never imports it, and importing it to ask (ray, ray.train, pandas) cost each rank 0.8 s."""
    if "ray.train" not in sys.modules:
        return False
    try:
        import ray.train

        ray.train.get_context().get_world_size()
        return True
    except Exception:
        return False
