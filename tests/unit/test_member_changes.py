"""The survivors path's changes of members on the run's record: what the leading worker records
(raydl.train.survivors.ChangeRecord), what Ray's controller tells (raydl.driver.member_watch), and the two merged
(raydl.metrics.members). Pure: no processes (tests/ray/test_survivors.py kills a real worker)."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

from raydl.data.order import DataPosition
from raydl.driver.member_watch import NODE_GONE, PROCESS_ENDED, how_it_ended, lost_line
from raydl.metrics.members import MemberChanges
from raydl.train.survivors import ChangeRecord, Members

GB, SPE = 64, 60   # global batch, steps per epoch


def at(steps: int) -> DataPosition:
    """The data position after `steps` steps of the run's data order."""
    return DataPosition((steps - 1) // SPE, ((steps - 1) % SPE + 1) * GB) if steps else DataPosition()


def commit(record: ChangeRecord, ranks: set[int], step: int, *, took: int | None = None) -> None:
    """Step `step` committed by `ranks`, after step - 1; it took the rows of the data order's step `took`
    (default: `step`)."""
    record.began()
    record.committed(Members(0, len(ranks), frozenset(ranks)), before=at(step - 1), after=at(took or step),
                     step=step, steps_per_epoch=SPE, global_batch=GB)


def test_a_loss_with_its_step_redone_then_a_join_are_recorded_once_each():
    record = ChangeRecord()
    for step in range(1, 36):
        commit(record, {0, 1}, step)
    assert record.take() == []              # the same members all along
    record.began()
    record.discarded()                       # step 36 in flight when worker 1 died: its all-reduce failed
    commit(record, {0}, 36)
    commit(record, {0}, 37)
    commit(record, {0, 1}, 38)
    lost, joined = record.take()
    assert (lost["event"], lost["rank"], lost["step"], lost["workers"], lost["steps_redone"]) == ("lost", 1, 36, 1, 1)
    assert lost["stall_s"] >= 0 and lost["samples_lost"] == lost["samples_repeated"] == 0
    assert (joined["event"], joined["rank"], joined["step"], joined["workers"], joined["steps_redone"]) == \
        ("joined", 1, 38, 2, 0)
    assert record.take() == []


def test_rows_skipped_or_taken_twice_at_a_change_are_counted_across_an_epoch_end():
    record = ChangeRecord()
    commit(record, {0, 1}, SPE - 1)
    commit(record, {0}, SPE, took=SPE + 1)     # the first step of the next epoch: the epoch's last step skipped
    commit(record, {0, 1}, SPE + 1, took=SPE)   # step 60's rows: taken twice
    lost, joined = record.take()
    assert (lost["samples_lost"], lost["samples_repeated"]) == (GB, 0)
    assert (joined["samples_lost"], joined["samples_repeated"]) == (0, GB)


def test_a_process_killed_and_a_node_lost_are_told_as_ray_tells_them():
    died = RayActorError("a1", "The actor died unexpectedly before finishing this task.\nThe actor is dead because "
                               "its worker process has died. Worker exit type: SYSTEM_ERROR")
    assert how_it_ended(WorkerHealthCheckFailedError("A worker health check failed.", failure=died)) == PROCESS_ENDED
    gone = RayActorError("a1", "The actor died because its node has died. Node Id: 6eeb")
    assert how_it_ended(WorkerHealthCheckFailedError("failed", failure=gone)) == NODE_GONE
    unavailable = ActorUnavailableError("RpcError: Connection refused", None)
    assert how_it_ended(WorkerHealthCheckFailedError("failed", failure=unavailable)) == PROCESS_ENDED
    assert how_it_ended(WorkerHealthCheckFailedError("failed", failure=unavailable), node_answers=False) == NODE_GONE
    assert how_it_ended(ActorDiedError()) == "its Ray actor died"
    assert how_it_ended(ValueError("bad shard\nmore")) == "it failed: ValueError: bad shard"
    assert lost_line(1, 8671, "10.0.0.5 (6eebd165)", PROCESS_ENDED, 1) == (
        f"worker 1 (pid 8671) on node 10.0.0.5 (6eebd165) died: {PROCESS_ENDED}; the other worker goes on; "
        f"a replacement is starting")
    assert lost_line(2, 7, "n", NODE_GONE, 3).endswith(
        "the other 3 workers go on; a replacement starts once a node has room for it")


def test_the_record_merges_the_leaders_view_with_rays_in_either_order():
    changes = MemberChanges()
    changes.from_ray({"event": "lost", "rank": 1, "time": 10.0, "node": "n1", "pid": 11, "how": PROCESS_ENDED})
    changes.from_worker({"event": "lost", "rank": 1, "time": 11.0, "step": 36, "stall_s": 1.1})
    changes.from_worker({"event": "joined", "rank": 1, "time": 30.0, "step": 80, "stall_s": 0.4})
    changes.from_ray({"event": "joined", "rank": 1, "time": 20.0, "node": "n2", "pid": 12})
    changes.from_ray({"event": "lost", "rank": 0, "time": 40.0, "node": "n2", "pid": 10, "how": NODE_GONE})
    lost, joined, unrecorded = changes.summary()
    assert lost == {"event": "lost", "rank": 1, "time": 11.0, "step": 36, "stall_s": 1.1, "node": "n1", "pid": 11,
                    "how": PROCESS_ENDED}
    assert joined == {"event": "joined", "rank": 1, "time": 30.0, "step": 80, "stall_s": 0.4, "node": "n2", "pid": 12}
    assert unrecorded["rank"] == 0 and "step" not in unrecorded   # the run ended before a worker recorded it
