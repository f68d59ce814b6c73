"""raydl bench recovery times the restarted group's first step, not a step the old group finished late; on the
survivors path, the survivors' next step."""

from raydl.bench import recovery
from raydl.bench.recovery import after_fault
from raydl.cli import main


def record(step: int, time: float, world_size: int = 2) -> dict:
    return {"step": step, "time": time, "world_size": world_size}


def test_a_step_in_flight_at_the_fault_is_not_the_recovery():
    # old group: steps 31..36, step 36 ends just after the fault (t=100); new group resumes at 30: 31..37
    records = [record(s, 90 + s - 31) for s in range(31, 36)] + [record(36, 100.02)]
    records += [record(s, 110 + s - 31) for s in range(31, 38)]
    first, progress = after_fault(records, {"resumed_at_step": 30}, 100.0, done_before=35)
    assert first == record(31, 110) and progress == record(36, 115)


def test_nothing_redone_the_new_group_starts_after_the_old_ones_last_step():
    records = [record(s, 90 + s) for s in range(1, 6)] + [record(s, 120 + s) for s in range(6, 9)]
    first, progress = after_fault(records, {"resumed_at_step": 5}, 100.0, done_before=5)
    assert first == record(6, 126) and progress == first


def test_without_a_restart_the_survivors_first_step_alone_ends_the_stall():
    # steps 1..10 every second; the fault at t=10.5 discards step 11, which the survivor redoes alone, done at t=13
    records = [record(s, float(s)) for s in range(1, 11)] + [record(s, 2.0 + s, 1) for s in range(11, 14)]
    first, progress = after_fault(records, {}, 10.5, done_before=10)
    assert first == progress == record(11, 13.0, 1)


def test_a_step_in_flight_that_the_survivor_commits_is_not_the_end_of_the_stall():
    # the fault at t=10.5 came after step 11's all-reduce: step 11 ends at 10.6 at 2 workers, step 12 alone at 13
    records = [record(s, float(s)) for s in range(1, 11)] + [record(11, 10.6)] + [record(12, 13.0, 1)]
    first, progress = after_fault(records, {}, 10.5, done_before=10)
    assert first == progress == record(12, 13.0, 1)


def test_set_overrides_every_side_last_and_a_bad_one_fails_before_anything_starts(tmp_path, capsys):
    for fault in ("none", "worker_kill"):
        sides = [recovery.run_config(tmp_path, 100, fault, s, tmp_path / "ledger", ("model.size=small",))
                 for s in recovery.FAULT_SETTINGS[fault]]
        assert all(o[-1] == "model.size=small" for o in sides), sides
    rc = main(["bench", "recovery", "--faults", "none", "--set", "model.sise=small", "--out", str(tmp_path / "r.json")])
    assert rc == 2 and "did you mean 'size'" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
