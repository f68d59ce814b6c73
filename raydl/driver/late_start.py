"""Train's two guard actors, started once a worker group has reported instead of while it starts.

On a shared cluster Ray Train starts a PlacementGroupCleaner actor with its controller and a PreemptionWatcher
with every worker group. Each is a new Python process that imports most of ray.train (about 3 and 1.5 CPU
seconds), at the very time the Train workers start and import torch: on a small node (2 CPUs here) they take
CPU and one of the raylet's worker-start slots from the workers, and the first step comes seconds later
(raydl bench startup --warm). Started at the group's first report (telemetry.report_every steps in), they cost
the same CPU once, and guard the run from then on: the cleaner removes the group's placement group if the
controller dies, the watcher passes drain notices to the workers (raydl's checkpoint at a preemption notice).

The hooks overridden here are Ray 2.60's (pinned by pyproject's ray range); tests/unit/test_late_start.py,
tests/ray/test_late_start.py and tests/ray/test_faults.py (preemption) cover them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from ray._common.utils import env_bool
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
from ray.train.v2._internal.constants import DEFAULT_ENABLE_PREEMPTION_WATCHER, ENABLE_PREEMPTION_WATCHER_ENV_VAR
from ray.train.v2._internal.execution.callback import ReportCallback, WorkerGroupCallback


class AtFirstReport(WorkerGroupCallback, ReportCallback):
    """Calls `start(worker_group)` once per worker group, at its first report (in the Train controller)."""

    _waiting = None   # the started worker group that has not reported yet

    def after_worker_group_start(self, worker_group) -> None:
        self._waiting = worker_group

    def after_report(self, training_report, metrics) -> None:
        if self._waiting is not None:
            group, self._waiting = self._waiting, None
            self.start(group)

    def start(self, worker_group) -> None:
        raise NotImplementedError

    def before_worker_group_shutdown(self, worker_group) -> None:
        self._waiting = None
        super().before_worker_group_shutdown(worker_group)

    def after_worker_group_abort(self, worker_group_context) -> None:
        self._waiting = None
        super().after_worker_group_abort(worker_group_context)


class LateCleanerCallback(AtFirstReport, PlacementGroupCleanerCallback):
    """PlacementGroupCleanerCallback that launches its cleaner at the first group's first report."""

    _run_context = None

    def after_controller_start(self, train_run_context) -> None:
        self._run_context = train_run_context

    def after_worker_group_start(self, worker_group) -> None:
        if self._cleaner is None:
            super().after_worker_group_start(worker_group)
        else:   # a restarted group: the cleaner runs already
            self._register(worker_group)

    def start(self, worker_group) -> None:
        PlacementGroupCleanerCallback.after_controller_start(self, self._run_context)
        if self._cleaner is not None:   # else Ray's callback logged why it could not launch one
            self._register(worker_group)

    def _register(self, worker_group) -> None:
        """Without waiting for the answer (Ray's callback does): the cleaner may still be importing, and the
        controller must keep draining reports meanwhile. Calls to one actor run in the order they were made."""
        placement_group = worker_group.get_worker_group_state().placement_group_handle.placement_group
        self._cleaner.register_placement_group.remote(placement_group)


class LateWatcherCallback(AtFirstReport, PreemptionCallback):
    """PreemptionCallback that starts each group's watcher at that group's first report."""

    def start(self, worker_group) -> None:
        PreemptionCallback.after_worker_group_start(self, worker_group)


@contextmanager
def watcher_started_late(callbacks: list) -> Iterator[None]:
    """While the Train controller starts: its own PreemptionCallback switched off (the controller reads the
    switch from the driver's environment) and LateWatcherCallback in `callbacks` instead. The user's
    RAY_TRAIN_ENABLE_PREEMPTION_WATCHER still decides whether there is a watcher at all."""
    if not env_bool(ENABLE_PREEMPTION_WATCHER_ENV_VAR, DEFAULT_ENABLE_PREEMPTION_WATCHER):
        yield
        return
    callbacks.append(LateWatcherCallback())
    users = os.environ.get(ENABLE_PREEMPTION_WATCHER_ENV_VAR)
    os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR] = "0"
    try:
        yield
    finally:
        if users is None:
            del os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR]
        else:
            os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR] = users
