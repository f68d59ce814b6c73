"""Train's guard actors start at a worker group's first report (raydl.driver.late_start), not while it starts."""

from __future__ import annotations

import os

import pytest
from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR

from raydl.driver.late_start import AtFirstReport, LateWatcherCallback, watcher_started_late


class Recorder(AtFirstReport):
    def __init__(self):
        self.started = []

    def start(self, worker_group) -> None:
        self.started.append(worker_group)


def test_start_runs_once_per_group_at_its_first_report():
    hook = Recorder()
    hook.after_worker_group_start("group 1")
    assert hook.started == []                          # the group started, nothing reported yet
    for _ in range(3):
        hook.after_report(training_report=None, metrics=[{}])
    hook.after_worker_group_start("group 2")           # a restart
    hook.after_report(training_report=None, metrics=[{}])
    assert hook.started == ["group 1", "group 2"]


@pytest.mark.parametrize("end", ["before_worker_group_shutdown", "after_worker_group_abort"])
def test_a_group_that_ends_before_reporting_starts_nothing(end):
    hook = Recorder()
    hook.after_worker_group_start("group 1")
    getattr(hook, end)("group 1")
    hook.after_report(training_report=None, metrics=[{}])
    assert hook.started == []


@pytest.mark.parametrize("users", [None, "1", "true"])
def test_trains_own_watcher_is_off_while_the_controller_runs_and_the_late_one_replaces_it(monkeypatch, users):
    if users is None:
        monkeypatch.delenv(ENABLE_PREEMPTION_WATCHER_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENABLE_PREEMPTION_WATCHER_ENV_VAR, users)
    callbacks = []
    with watcher_started_late(callbacks):
        assert os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR] == "0"
        assert [type(c) for c in callbacks] == [LateWatcherCallback]
    assert os.environ.get(ENABLE_PREEMPTION_WATCHER_ENV_VAR) == users


def test_a_watcher_switched_off_by_the_user_stays_off(monkeypatch):
    monkeypatch.setenv(ENABLE_PREEMPTION_WATCHER_ENV_VAR, "0")
    callbacks = []
    with watcher_started_late(callbacks):
        assert callbacks == []
    assert os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR] == "0"
