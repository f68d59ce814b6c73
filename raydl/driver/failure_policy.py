"""Which worker failures Ray Train retries: only those a restart can fix.

Ray's default policy retries every worker-group error `max_failures` times (80-160 s here)
before the user sees it. A raydl error raised inside a worker (bad config, bad data, an
unusable checkpoint, a diverged loss) is deterministic: the next attempt fails the same way.
This policy decides RAISE for those at once and leaves every other decision to Ray's.
"""

from __future__ import annotations

from contextlib import nullcontext

from ray.exceptions import RayActorError
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
from ray.train.v2.api.exceptions import WorkerGroupError

from raydl.driver.finished_watch import FinishedRunWatch
from raydl.driver.late_start import LateCleanerCallback, watcher_started_late
from raydl.driver.scaling_policy import LiveNodesElasticPolicy, SurvivorsElasticPolicy
from raydl.errors import raydl_error_in


class FailFastOnRaydlErrors(FailurePolicy):
    def __init__(self, fallback: FailurePolicy):
        super().__init__(fallback.failure_config)
        self.fallback = fallback

    def make_decision(self, training_failed_error) -> FailureDecision:
        if isinstance(training_failed_error, WorkerGroupError) and raydl_error_in(training_failed_error):
            return FailureDecision.RAISE
        return self.fallback.make_decision(training_failed_error)


class RaydlTrainer(TorchTrainer):
    """TorchTrainer whose controller uses `FailFastOnRaydlErrors` around Ray's own failure policy and, when
    elastic, `LiveNodesElasticPolicy` (raydl.driver.scaling_policy; `SurvivorsElasticPolicy` when the backend
    declares replica groups: the survivors path), that starts Train's guard actors once the
    workers have reported (raydl.driver.late_start), that leaves Ctrl-C to raydl's handler, and that prints the
    run's console lines from its metrics sink.

    Ray 2.60 builds the policy inside `fit()` with no public hook; these overrides of the two methods involved
    are pinned by pyproject's ray range and tested (tests/unit/test_failure_policy.py, tests/ray/test_stop.py)."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        controller_init_kwargs["failure_policy"] = FailFastOnRaydlErrors(controller_init_kwargs["failure_policy"])
        survivors = self.backend_config.backend_cls.has_replica_groups
        if isinstance(controller_init_kwargs["scaling_policy"], ElasticScalingPolicy):
            controller_init_kwargs["scaling_policy"] = (SurvivorsElasticPolicy if survivors else
                                                        LiveNodesElasticPolicy)(self.scaling_config)
        self.finished_watch = FinishedRunWatch(self.run_dir, self.metrics_sink) if survivors else None
        with watcher_started_late(controller_init_kwargs["callbacks"]), self.finished_watch or nullcontext():
            try:
                return super()._initialize_and_run_controller(**controller_init_kwargs)
            except RayActorError:
                if self.finished_watch is None or not self.finished_watch.ended_run:
                    raise
                return ended_result(self.run_dir, self.finished_watch.failure)

    private_ray = False   # build_trainer says whether raydl started this Ray privately (no --address)
    metrics_sink = None   # build_trainer's sink actor: its console lines are printed here while the run trains
    run_dir = None        # build_trainer's run directory (where the sink writes summary.json)
    finished_watch = None

    def fit(self):
        from raydl.metrics.sink import relay_lines

        with relay_lines(self.metrics_sink):
            try:
                return super().fit()
            except BaseException:
                self._fail_trackers()
                raise

    def _fail_trackers(self) -> None:
        """Tell the sink the run failed, for its experiment trackers; waited for (briefly), since the driver exits next."""
        import ray

        if self.metrics_sink is None:
            return
        try:
            ray.get(self.metrics_sink.fail_trackers.remote(), timeout=30)
        except ray.exceptions.RayError:   # the sink went with the cluster: its tracker runs stay as they were
            pass

    def _create_default_callbacks(self):
        """Two of Train's default callbacks only cost raydl time. Its DatasetsCallback starts a DatasetManager
        actor at every worker-group start even when the trainer has no datasets (raydl reads its own shards):
        one more process to spawn on the critical path of every start and restart. Train's
        PlacementGroupCleaner removes a run's placement group after its driver dies; on a private local Ray,
        which dies with the driver anyway and has no dashboard, it only logs a failed State API query every
        second (98 lines in a default run). On a shared cluster it is needed: keep it there, launched once the
        workers have reported (raydl.driver.late_start)."""
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

        unneeded = (PlacementGroupCleanerCallback,) + (() if self.datasets else (DatasetsCallback,))
        late_cleaner = [] if self.private_ray else [LateCleanerCallback()]
        return [c for c in super()._create_default_callbacks() if not isinstance(c, unneeded)] + late_cleaner

    def _register_sigint_handler(self, controller) -> None:
        """Ray's handler aborts the run on Ctrl-C; raydl's (`raydl.signals.SignalStop`, passed on by the run's metrics
        sink) checkpoints first. (Called with the controller once it exists: the survivors path's FinishedRunWatch
        may have to stop it.)"""
        if self.finished_watch is not None:
            self.finished_watch.controller = controller


def ended_result(run_dir, failure: tuple[int, Exception, str] | None):
    """What `fit` returns for a run FinishedRunWatch ended: Ray's Result, naming the run's last checkpoint, with
    the error of the worker whose `failure` (rank, error, traceback) ended it as Ray's controller makes it from a
    failed worker's (`fit` raises it)."""
    from ray.train import Checkpoint
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus
    from ray.train.v2.api.result import Result

    from raydl.driver.run_location import checkpoints_location
    from raydl.train import checkpoint as ckpt

    location = checkpoints_location(str(run_dir))
    latest = ckpt.find_latest(location)
    error = None
    if failure:
        rank, cause, traceback = failure
        failed = WorkerStatus(running=False, error=UserExceptionWithTraceback(cause, traceback_str=traceback))
        error = WorkerGroupPollStatus({rank: failed}).get_worker_group_error()
    return Result(metrics=None, checkpoint=Checkpoint(str(latest)) if latest else None, error=error, path=location)
