"""Which worker failures are retried: raydl's own (deterministic) errors raise at once, the rest follow Ray."""

from __future__ import annotations

import socket

import pytest
from ray import cloudpickle

from ray.exceptions import RayTaskError
from ray.train import FailureConfig
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
from ray.train.v2.api.exceptions import WorkerGroupError

from raydl.driver.failure_policy import FailFastOnRaydlErrors
from raydl.errors import raydl_error_in
from raydl.errors import DataError, TrainingDivergedError


def diverged() -> TrainingDivergedError:
    return TrainingDivergedError(step=7, loss=float("nan"), lr=3e-3, last_finite=(6, 2.5), checkpoint_step=5,
                            run_dir="runs/x", grad_clip=1.0, precision="fp16")


def as_worker_failure(error: Exception) -> Exception:
    """The exception as the controller sees it: wrapped by Ray's task machinery, after a pickle round trip."""
    try:
        raise error
    except Exception as e:
        wrapped = RayTaskError("train_fn", "traceback text", e)
    return cloudpickle.loads(cloudpickle.dumps(wrapped.as_instanceof_cause()))


def test_raydl_errors_raise_at_once_others_retry():
    policy = FailFastOnRaydlErrors(DefaultFailurePolicy(FailureConfig(max_failures=3)))
    crash = WorkerGroupError("rank 1 died", {1: as_worker_failure(RuntimeError("connection reset"))})
    assert [policy.make_decision(crash) for _ in range(4)] == [FailureDecision.RETRY] * 3 + [FailureDecision.RAISE]
    for error in (DataError("shard_00003.parquet is corrupt"), diverged()):
        fresh = FailFastOnRaydlErrors(DefaultFailurePolicy(FailureConfig(max_failures=3)))
        assert fresh.make_decision(WorkerGroupError("bad", {0: as_worker_failure(error)})) == FailureDecision.RAISE


def test_diverged_error_is_one_paragraph_that_survives_pickling():
    error = raydl_error_in(WorkerGroupError("bad", {0: as_worker_failure(diverged())}))
    text = str(error)
    assert isinstance(error, TrainingDivergedError) and error.exit_code == 1
    assert "\n" not in text and "step 7" in text and "2.5000 at step 6" in text and "step 5 is kept" in text
    assert "--resume runs/x" in text and "bf16 instead of fp16" in text and "train.lr" in text


@pytest.mark.parametrize("private_ray", [True, False])
def test_no_dataset_manager_without_datasets_and_a_late_cleaner_on_shared_clusters_only(private_ray):
    from ray.train import ScalingConfig
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from raydl.driver.failure_policy import RaydlTrainer
    from raydl.driver.late_start import LateCleanerCallback

    trainer = RaydlTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    trainer.private_ray = private_ray
    kinds = [type(c) for c in trainer._create_default_callbacks()]
    assert DatasetsCallback not in kinds and PlacementGroupCleanerCallback not in kinds   # Train's own, at start
    assert kinds.count(LateCleanerCallback) == (0 if private_ray else 1)


def test_dead_unknown_and_silent_nodes_are_not_counted_for_a_restart():
    from raydl.driver.cluster_watch import raylet_answers
    from raydl.driver.scaling_policy import live_only

    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))      # bound, not listening: connections are refused, as to a dead raylet
        port, dead_port = listening.getsockname()[1], closed.getsockname()[1]
        node = lambda node_id, alive, p: {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": "127.0.0.1",
                                         "NodeManagerPort": p}
        reserved = {"up": {"CPU": 1.0}, "gcs_dead": {"CPU": 1.0}, "raylet_gone": {"CPU": 1.0}, "unknown": {"CPU": 2.0}}
        nodes = [node("up", True, port), node("gcs_dead", False, port), node("raylet_gone", True, dead_port)]
        assert live_only(reserved, nodes, raylet_answers) == {"up": {"CPU": 1.0}}


def test_survivors_policy_keeps_the_size_while_it_replaces_and_never_shrinks_by_a_restart():
    """Ray replaces failed replica groups alone only at the same worker count: after a failure of some workers
    the survivors path's policy decides the group's size (the replacement waits for a node), after a failure of
    all of them it sizes the group as Ray's elastic policy does."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.controller.state import RestartingState, RunningState
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision
    from ray.train.v2.api.exceptions import ControllerError

    from raydl.driver.scaling_policy import SurvivorsElasticPolicy, replaces_alone

    one_died = WorkerGroupError("rank 1 died", {1: RuntimeError("node lost")})
    both_died = WorkerGroupError("all died", {0: RuntimeError("x"), 1: RuntimeError("y")})
    assert replaces_alone(one_died, 2) and not replaces_alone(both_died, 2) and not replaces_alone(one_died, None)
    assert not replaces_alone(ControllerError(RuntimeError("start failed")), 2)

    class Requests:   # Ray's autoscaling-coordinator client: the policy keeps asking for max_workers
        sent = 0

        def maybe_send_resource_request(self, scaling_config, num_workers):
            self.sent = num_workers

    policy = SurvivorsElasticPolicy(ScalingConfig(num_workers=(1, 2)))
    policy._coordinator_client = Requests()
    policy.on_controller_start_worker_group(scaling_config=policy.scaling_config, num_workers=2)
    policy.after_controller_state_update(RunningState(), RestartingState(training_failed_error=one_died))
    assert policy.make_decision_for_non_running_worker_group() == ResizeDecision(2, {"CPU": 1.0})
    assert policy._coordinator_client.sent == 2
    policy.after_controller_state_update(RestartingState(one_died), RunningState())
    assert not policy._replacing
    policy.after_controller_state_update(RunningState(), RestartingState(training_failed_error=both_died))
    assert not policy._replacing   # a restart of the whole group: Ray's elastic sizing

    class Group:
        num_workers, start_time = 2, float("-inf")

    policy._get_reserved_resources = lambda: {"head": {"CPU": 1.0}}   # one worker fits
    assert policy.make_decision_for_running_worker_group(Group(), None) == NoopDecision()
    policy._latest_monitor_time = float("-inf")
    policy._get_reserved_resources = lambda: {"head": {"CPU": 1.0}, "new": {"CPU": 1.0}}
    Group.num_workers = 1
    assert policy.make_decision_for_running_worker_group(Group(), None) == ResizeDecision(2, {"CPU": 1.0})


def test_a_survivors_error_unseen_by_the_controller_ends_the_run_as_the_controller_would_have(tmp_path):
    """A worker's error on the survivors path stays with the sink until the controller reports that rank's error;
    the run FinishedRunWatch ends with it raises what Ray's controller raises: a DataError is still found
    (the one paragraph, exit 2), any other error is Ray's WorkerGroupError with the worker's traceback (exit 1)."""
    from raydl.driver.failure_policy import ended_result
    from raydl.metrics.sink import MetricsSink

    sink = MetricsSink(str(tmp_path), False, None, {}, None)
    corrupt = cloudpickle.loads(cloudpickle.dumps(DataError("shard_00003.parquet is corrupt")))   # as it travels
    sink.note_worker_error(1, corrupt, "Traceback ...\nDataError: shard_00003.parquet is corrupt\n")
    sink.note_failure("rank 0: ActorDiedError: the node died", [0])   # the lost node's worker, seen before
    assert sink.error_unseen()[1:3] == (1, corrupt)
    error = ended_result(tmp_path, sink.error_unseen()[1:]).error
    assert isinstance(error, WorkerGroupError) and raydl_error_in(error) is corrupt and corrupt.exit_code == 2
    sink.note_failure("rank 1: DataError: shard_00003.parquet is corrupt", [1])
    assert sink.error_unseen() is None

    crash = ended_result(tmp_path, (1, RuntimeError("injected"), "Traceback ...\nRuntimeError: injected\n")).error
    assert raydl_error_in(crash) is None and "RuntimeError: injected" in str(crash)
    assert ended_result(tmp_path, None).error is None


def test_the_coordinator_rereads_the_nodes_once_per_resize_check(monkeypatch):
    """Ray's coordinator refreshes its view of the nodes every 20 s; the policy asks it to re-read them before a
    query at most once per scaling.resize_check_s, so a node added is seen at the next check."""
    from ray.train import ScalingConfig

    from raydl.driver import scaling_policy

    class Coordinator:   # records the calls the policy sends to Ray's AutoscalingCoordinator actor
        def __init__(self):
            self.calls = []
            self.get_reserved_resources = self

        def remote(self, requester_id, recompute=False):
            self.calls.append((requester_id, recompute))
            return "reference"

    class Client:
        _autoscaling_coordinator = Coordinator()

    now = [100.0]
    monkeypatch.setattr(scaling_policy, "time_monotonic", lambda: now[0])
    monkeypatch.setattr(scaling_policy.ray, "get", lambda ref, timeout=None: {"node": {"CPU": 1.0}})
    monkeypatch.setattr(scaling_policy.ray, "nodes", lambda: [])
    monkeypatch.setattr(scaling_policy, "live_only", lambda reserved, nodes: reserved)   # tested above
    policy = scaling_policy.LiveNodesElasticPolicy(ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=5))
    policy._requester_id, policy._coordinator_client = "train-run", Client()
    calls = Client._autoscaling_coordinator.calls
    for t in (100.0, 102.0, 104.9, 105.0, 111.0):
        now[0] = t
        policy._latest_reserved_resources_query_time = float("-inf")   # Ray's 1 s cache of the answer: past
        assert policy._get_reserved_resources() == {"node": {"CPU": 1.0}}
    refreshes = [c for c in calls if c[1]]
    assert refreshes == [("train-run", True)] * 3, calls   # at 100, 105 and 111: each a query of its own after it
    assert calls[0] == ("train-run", True) and calls[1] == ("train-run", False) and len(calls) == 8
