"""Fault suite (issue 5): a raydl run on a multi-node Ray cluster on one machine survives worker kills, node
loss, node gain, preemption, a corrupt checkpoint and a kill during a checkpoint write, and loses nothing.

One `ray.cluster_utils.Cluster` for the module: a 1-CPU head and 1-CPU worker nodes (one Train worker per node),
added and removed per test. Each run is the default tiny GPT on the built-in task, 4096 rows (3840 train rows =
one epoch of 60 steps at the global batch of 64; 120 steps), in a subprocess (tests/ray/fault_harness.py); faults come
from outside, as real ones do. Every test checks:

  * the run finishes (Result, summary.json);
  * the sample-id ledger: the ids of the committed steps (each attempt up to the checkpoint the next attempt
    loaded, plus the last attempt) are every sample of each epoch exactly once;
  * the final loss against the fault-free run (torchrun, same config): exactly equal where every attempt
    trained with the reference's layout (dp=2); where the layout changed, equal up to the restart and within 1e-4
    at every step after it (see RESUME_TOLERANCE).

    RAY_TMPDIR=/tmp/ray-$USER pytest tests/ray/test_faults.py -s     # -s prints the [fault] timings
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from raydl.data.dataset import resolve_path
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt
from raydl.bench.fault_cluster import FaultCluster, Run, poll, train_workers
from raydl.bench.procs import kill
from raydl.data.ledger_read import attempts, committed_ids, epoch_ids, read_ledger
from tests.helpers import not_raydls
from tests.ray.fault_harness import (checkpoints, held, ledger, ledger_run, newest_registered, open_files,
                                     preempted_checkpoints, reference_run, release)

pytestmark = [pytest.mark.slow]

# Where the layout changed, the result is compared with the fault-free run at the run's *first* layout, step by step:
#  * every step before the first restart: equal within 1e-6 relative (same layout: in practice bit-identical);
#  * every step after it: equal within 1e-4. The first runs on the checkpoint's weights and data position, the next
#    on its optimizer state and lr too; only the sums' order differs in the new layout. A wrong or partial resume
#    shows at once, far above the float noise: measured at most 1.9e-7 (2 -> 3 workers, pp=3) and 3.9e-8 (1 <-> 2
#    workers) over every step to the end (2026-11-29). These runs stay in the loss's plateau of the first 120 steps,
#    where rounding differences do not grow; until 2026-11-29 the growth runs went on to 600 steps, into the phase
#    where the task is learnt and another layout's rounding grows ~10x a step, and were held to an end band only.
RESUME_TOLERANCE = 1e-4
GB, STEPS, EVERY = 64, 120, 5      # 2 epochs of 60 steps
# Growth and drain must happen while the run trains: the runs hold at HOLD (debug.hold_at_step: every rank waits
# after reporting that step, its checkpoint saved) until the cluster has changed, so the change lands at a known
# step however slow the machine. A new node is seen at the next resize check (5 s here: raydl's policy has Ray's
# coordinator re-read the nodes, which it otherwise does every 20 s; 11-13 s measured from the node's start to a
# step at the new size), a drain notice within ~5 s. Until 2026-11-29 these runs were 600 steps (changed at step
# 300) so that the change came while the run trained on any machine, and for an end band that the deterministic
# checks after the resume now replace.
HOLD = 30
# The pipeline growth holds later: its bigger layout (3 stages, 0.3-0.4 s a step on 2 cores) is the slower one.
GROWTH_HOLD = 90


def base(data_cache: Path) -> list[str]:
    return [f"data.cache_dir={data_cache}", "data.builtin_samples=4096", f"train.global_batch_size={GB}",
            f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", f"telemetry.report_every={EVERY}",
            "train.eval_batches=2", "telemetry.progress=false",
            "checkpoint.memory_every_steps=0",   # recovery from storage checkpoints (from memory: test_restart_from_memory.py)
            "scaling.survivors=off"]   # the full-restart path; tests/ray/test_survivors.py tests the other


@pytest.fixture(scope="module")
def cluster():
    c = FaultCluster()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def references(data_cache, tmp_path_factory):
    """reference(*overrides, nproc=2) -> the fault-free run of base + overrides (forked gloo ranks:
    fault_harness.reference_run); cached."""
    cache: dict[tuple, dict] = {}

    def reference(*overrides: str, nproc: int = 2) -> dict:
        if (nproc, overrides) not in cache:
            cache[nproc, overrides] = reference_run(tmp_path_factory.mktemp("reference") / "run",
                                                    [*base(data_cache), *overrides], nproc=nproc)
        return cache[nproc, overrides]
    return reference


@pytest.fixture(scope="module")
def reference(references) -> dict:
    return references()


def data_dir(data_cache: Path) -> Path:
    cfg = load_config(None, base(data_cache))
    return Path(resolve_path(cfg, choose_model(cfg.model).spec.task))


@pytest.fixture
def run_on(cluster, data_cache, tmp_path):
    """start(*overrides) -> a started Run on the cluster; stopped at teardown if still running."""
    runs = []

    def start(*overrides: str) -> Run:
        runs.append(ledger_run(tmp_path, [*base(data_cache), *overrides], cluster.address).start())
        return runs[-1]

    yield start
    for r in runs:
        r.stop()


def assert_exactly_once(run: Run, data_cache: Path) -> None:
    expected = epoch_ids(data_dir(data_cache))
    committed = committed_ids(ledger(run))
    steps = json.loads((run.root / "summary.json").read_text())["steps"]
    assert sorted(committed) == list(range(steps * GB // len(expected))), sorted(committed)
    for epoch, ids in committed.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch}: {len(ids) - len(set(ids))} samples trained twice"
        assert sorted(ids) == expected, f"epoch {epoch}: {len(set(expected) - set(ids))} samples never trained"


def assert_same_result(summary: dict, reference: dict) -> None:
    """Same layout, deterministic CPU kernels, RNG reseeded from (seed, step, rank): bit-identical."""
    assert summary["steps"] == reference["steps"] and summary["samples"] == reference["samples"]
    assert summary["final_loss"] == reference["final_loss"], (summary["final_loss"], reference["final_loss"])
    assert summary["eval"] == reference["eval"]


def assert_resumed_like_reference(run: Run, summary: dict, reference: dict) -> None:
    """The checks above, for a run whose layout changed at each restart (one or more)."""
    assert summary["steps"] == reference["steps"] and summary["samples"] == reference["samples"]
    records, want = run.records(), reference["losses"]
    resumed = [r["resumed_at_step"] for r in summary["restarts"]]
    # Each restart resumed past the one before: the last record of each step after a restart is the new group's.
    assert resumed == sorted(set(resumed)), summary["restarts"]
    for r in records:
        if r["step"] <= resumed[0]:
            assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-6), (r["step"], r["loss"], want[r["step"]])
    for at in resumed:
        first = [r for r in records if r["step"] == at + 1][-1]      # the redone step of the new group
        log(f"first step after the restart ({first['step']}, {first['world_size']} workers): loss {first['loss']:.7f} "
            f"vs fault-free {want[first['step']]:.7f}")
        assert first["loss"] == pytest.approx(want[first["step"]], rel=RESUME_TOLERANCE)
    after = {r["step"]: r["loss"] for r in records if r["step"] > resumed[0]}   # a step redone: its last record
    worst = max(abs(loss / want[s] - 1) for s, loss in after.items())
    log(f"steps {resumed[0] + 1}-{max(after)} after the first restart: at most {worst:.1e} from the fault-free losses "
        f"(final {summary['final_loss']:.4f} vs {reference['final_loss']:.4f})")
    assert sorted(after) == list(range(resumed[0] + 1, summary["steps"] + 1)), sorted(after)
    assert worst <= RESUME_TOLERANCE, [(s, loss, want[s]) for s, loss in after.items()
                                       if abs(loss / want[s] - 1) > RESUME_TOLERANCE]


def log(msg: str) -> None:
    print(f"[fault] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------- 1, 5, 6
def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
    path.write_bytes(bytes(data))


def settled_checkpoints(run: Run) -> list[int]:
    """Registered checkpoints once no report is in flight (the workers are stopped): two equal reads 1.5 s apart."""
    seen = []

    def stable():
        seen.append(checkpoints(run.run_dir))
        return len(seen) > 1 and seen[-1] == seen[-2] and len(seen[-1]) >= 2 and seen[-1]
    return poll("registered checkpoints to settle", stable, 30, lambda: str(seen), every_s=1.5)


def catch_checkpoint_write(run: Run, deadline_s: float) -> tuple[int, str]:
    """(pid, path): a worker with a DCP shard file open (writing, hashing or uploading a checkpoint).

    Polled without a pause: a write lasts a fraction of a second."""
    def writing() -> tuple[int, str] | None:
        return next(((pid, f) for pid in train_workers() for f in open_files(pid) if f.endswith(".distcp")), None)
    return run.wait_for("a worker writing a checkpoint", writing, deadline_s, every_s=0)


def kill_during_checkpoint_write(run: Run) -> tuple[int, Path, int]:
    """(the step being saved, the partial checkpoint, the newest checkpoint Ray had registered before the kill; 0 for
    none): a worker killed while it writes a checkpoint."""
    pid, path = catch_checkpoint_write(run, deadline_s=60)
    registered = newest_registered(run.run_dir)
    kill(pid)
    partial = Path(path).parent
    problem = ckpt.verify(partial)
    # The step being saved: the last one the killed rank took from its loader (the ledger names files by pid).
    writing = max(step["offset"] for log in read_ledger(ledger(run)) if log.pid == pid for step in log.steps) // GB
    log(f"killed pid {pid} while saving step {writing} ({path}); verify: {problem}")
    assert problem, f"{partial} verified complete: the kill came too late to test a partial write"
    return writing, partial, registered


def corrupt_newest_checkpoint_then_kill(run: Run) -> tuple[list[int], Path, Path]:
    """(registered steps, newest, previous): training frozen so that the newest checkpoint stays the newest, its
    shard corrupted, one worker killed and the other let go."""
    workers = run.workers(2)
    for pid in workers:
        kill(pid, signal.SIGSTOP)
    registered = settled_checkpoints(run)
    newest, previous = (run.run_dir / "train" / ckpt.checkpoint_name(s) for s in registered[-2:][::-1])
    flip_bytes(newest / "__0_0.distcp")
    assert ckpt.verify(newest) and ckpt.verify(previous) is None
    kill(workers[1])
    kill(workers[0], signal.SIGCONT)
    log(f"corrupted {newest.name}, killed a worker")
    return registered, newest, previous


def kill_mid_interval(run: Run, target: int, rng: random.Random) -> int:
    """A worker killed at `target` (a step after a checkpoint, before the next), then a step past it awaited;
    returns the newest checkpoint Ray had registered before the kill."""
    run.wait_step(target - 2, deadline_s=240)
    victim = rng.choice(run.workers(2))
    run.wait_step(target)
    registered = newest_registered(run.run_dir)
    assert kill(victim)
    t_kill, at = time.monotonic(), run.step()
    run.wait_for(f"a step after the kill at {at}", lambda: run.step() > at + 2, 180)
    log(f"kill at step {at} (newest registered checkpoint {registered}): {time.monotonic() - t_kill:.1f} s "
        "to a reported step past it")
    return registered


def test_five_worker_deaths_partial_and_corrupt_checkpoints_lose_nothing(cluster, run_on, reference, data_cache):
    """One run, five faults in turn (three tests of one kind of run, merged: issue 34): a worker killed while it
    writes a checkpoint (the partial one is never loaded), the newest checkpoint corrupted and a worker killed (the
    run falls back to the previous one), then a worker killed three times mid-interval. The same result as the
    fault-free run, to the bit, and every sample once."""
    cluster.resize(1)
    run = run_on("scaling.min_workers=2", "scaling.max_workers=2", "scaling.max_failures=5")
    run.wait_step(EVERY + 2, deadline_s=240)
    writing, partial, registered_at_write = kill_during_checkpoint_write(run)
    run.wait_step(22, deadline_s=240)
    registered, newest, previous = corrupt_newest_checkpoint_then_kill(run)
    rng = random.Random(0)
    # mid-interval: after the step-40/55/70 checkpoints, before the next
    registered_at_kill = [kill_mid_interval(run, target, rng) for target in (42, 57, 72)]
    summary = run.finish()

    assert summary["world_sizes"] == [2] and len(summary["restarts"]) == 5, summary["restarts"]
    at_write, at_corrupt, *mid_interval = summary["restarts"]
    # Never the partial checkpoint; the one before it, or an older one where Train's controller had not yet
    # registered that one when the worker died (it registers a report at its next poll: 0 steps behind in one run, 5
    # in another), never older than what it had registered.
    assert writing % EVERY == 0 and at_write["resumed_at_step"] % EVERY == 0, (writing, at_write)
    assert registered_at_write <= at_write["resumed_at_step"] <= writing - EVERY, (writing, registered_at_write, at_write)
    assert at_corrupt["resumed_at_step"] == registered[-2], (registered, at_corrupt)
    out = run.tail(10**7)
    assert f"checkpoint {newest} is not usable (__0_0.distcp is missing or does not match its checksum); " \
           f"falling back to {previous}" in out, out[-5000:]
    # Each resumes from the newest checkpoint Ray had registered when the worker died, or a newer one. How many steps
    # that is behind the last reported step depends on when Train's controller registered the last reports (its poll:
    # 5 steps behind in one run, 10 in another): not asserted.
    for r, newest in zip(mid_interval, registered_at_kill):
        assert r["cause"].startswith("rank ") and r["resumed_at_step"] % EVERY == 0, r
        assert newest <= r["resumed_at_step"] == r["step"] - r["steps_redone"] <= r["step"], (r, newest)
    # The driver's console (--address, a Ray the caller started): raydl's lines only, one per death.
    console = run.log.read_text()
    assert not not_raydls(console), "\n".join(not_raydls(console))
    assert console.count("[raydl] a worker failed: rank ") >= 5 and " died (" in console, console
    assert (run.run_dir / "ray.log").read_text().count("A worker died or was killed") >= 5
    assert len(attempts(ledger(run))) == 6
    assert_exactly_once(run, data_cache)
    assert_same_result(summary, reference)
    if partial.name.startswith("raydl-ckpt-"):
        shutil.rmtree(partial, ignore_errors=True)   # a SIGKILLed worker cannot clean up its temp dir


def add_node_and_wait(cluster, run, *, workers: int) -> None:
    """Add a node, then wait until the run reports a step at `workers` workers; then let it go on (a group that
    resumed before HOLD holds there again after reporting it)."""
    cluster.add()
    t_add = time.monotonic()
    run.wait_for(f"training at {workers} workers", lambda: run.world_size() == workers, 240)
    log(f"node added: {time.monotonic() - t_add:.1f} s to a reported step at {workers} workers")
    release(run)


def lose_node_without_notice(cluster, run, *, after_step: int) -> int:
    """Kill the worker node (as a crashed machine) once the 2-worker run reports `after_step`, then wait for a step
    at 1 worker; returns the newest checkpoint Ray had registered when the node went."""
    run.wait_step(after_step, deadline_s=240)
    at, t_loss, registered = run.step(), time.monotonic(), newest_registered(run.run_dir)
    assert run.world_size() == 2, run.records()[-1]   # the loss hits the grown group
    cluster.remove(cluster.nodes[0], graceful=False)
    run.wait_for("training at 1 worker", lambda: run.world_size() == 1 and run.step() > at, 240)
    log(f"node lost at step {at}: {time.monotonic() - t_loss:.1f} s to a reported step at 1 worker")
    return registered


# ---------------------------------------------------------------------------------------------------- 2, 3
def test_node_added_then_lost_without_notice_grows_and_shrinks(cluster, run_on, references, data_cache):
    """One run (two tests of one kind of run, merged: issue 34): a node added while the run holds at HOLD on the
    head alone, the run grows onto it; later that node lost without notice, mid-interval (2 steps past the step-40
    checkpoint), and the run shrinks back to 1 worker and continues."""
    cluster.resize(0)
    # Ray's resize checks at raydl's default interval (30 s), not the 5 s of the other growth test: a check in the
    # second after the node loss would see the node gone and resize before the surviving rank's error is heard (the
    # restart's cause then "resize 2 -> 1 workers", seen once in two runs at 5 s). The growth waits for the next
    # check; the run holds meanwhile, in sleep.
    run = run_on("scaling.min_workers=1", "scaling.max_workers=2", "scaling.max_failures=1",
                 f"debug.hold_at_step={HOLD}")
    held(run, 1)
    add_node_and_wait(cluster, run, workers=2)
    registered = lose_node_without_notice(cluster, run, after_step=42)
    summary = run.finish()

    assert summary["world_sizes"] == [1, 2], summary["world_sizes"]   # each size once, in order: the layouts say "back"
    layouts = [(x["world_size"], x["dp"], x["pp"], x["num_microbatches"]) for x in summary["layouts"]]
    assert layouts[:2] == [(1, 1, 1, 2), (2, 2, 1, 1)], layouts   # the global batch stays 64: 1 x 2 x 32, 2 x 1 x 32
    assert layouts[1:] == [(2, 2, 1, 1), (1, 1, 1, 2)], layouts   # and back at the loss
    grown, lost = summary["restarts"]
    assert grown["cause"] == "resize 1 -> 2 workers" and grown["steps_redone"] <= 10, grown
    assert grown["step"] == HOLD, grown          # the held group trained no further
    # From the newest checkpoint Ray had registered when the node went, or a newer one (not a step count: the last
    # reports may not be registered yet; 10 steps redone in one run, 5 in others).
    assert lost["cause"].startswith("rank ") and lost["resumed_at_step"] % EVERY == 0, lost
    assert registered <= lost["resumed_at_step"] == lost["step"] - lost["steps_redone"], (registered, lost)
    assert_exactly_once(run, data_cache)
    assert_resumed_like_reference(run, summary, references(nproc=1))


# ---------------------------------------------------------------------------------------------------- 4
def test_preemption_notice_checkpoints_shrinks_and_survives_max_failures_0(cluster, run_on, reference, data_cache):
    cluster.resize(1)
    run = run_on("scaling.min_workers=1", "scaling.max_workers=2", "scaling.max_failures=0",
                 f"debug.hold_at_step={HOLD}")
    held(run, 2)
    node = cluster.nodes[0]
    cluster.drain(node, deadline_s=15)
    t_notice = time.monotonic()
    try:
        notice = run.wait_for("a checkpoint at the notice", lambda: preempted_checkpoints(run.run_dir), 60)
        log(f"drain notice: checkpoint at step {notice[0]} after {time.monotonic() - t_notice:.1f} s")
    finally:
        cluster.remove(node, graceful=False)        # the spot node goes away
    run.wait_for("training at 1 worker", lambda: run.world_size() == 1, 240)
    log(f"drain notice: {time.monotonic() - t_notice:.1f} s to a reported step at 1 worker")
    release(run)
    summary = run.finish()

    assert summary["world_sizes"] == [2, 1], summary["world_sizes"]
    [restart] = summary["restarts"]
    assert restart["cause"] == f"preemption notice (checkpoint at step {notice[0]})", restart
    assert restart["resumed_at_step"] == notice[0] and restart["steps_redone"] == 0, (restart, notice)
    assert HOLD < notice[0] <= HOLD + EVERY, notice   # the notice ended the hold; its checkpoint at the next report
    assert_exactly_once(run, data_cache)
    assert_resumed_like_reference(run, summary, reference)


# ---------------------------------------------------------------------------------------------------- 7
def test_growth_changes_pipeline_layout(cluster, run_on, reference, data_cache):
    """pp=auto at 2 workers plans dp=2 (the planner's choice for this model), at 3 workers pp=3: the global batch
    of 64 does not split over 3 replicas, so the only layouts are 3 pipeline stages."""
    cluster.resize(1)
    run = run_on("scaling.min_workers=2", "scaling.max_workers=3", "scaling.resize_check_s=5",
                 "parallel.pp_degree=auto", f"debug.hold_at_step={GROWTH_HOLD}")
    held(run, 2)     # the 2-worker group has trained (and planned its layout)
    add_node_and_wait(cluster, run, workers=3)
    summary = run.finish()

    assert summary["world_sizes"] == [2, 3], summary["world_sizes"]
    first, last = summary["layouts"][0], summary["layouts"][-1]
    assert (first["world_size"], last["world_size"]) == (2, 3) and (last["dp"], last["pp"]) == (1, 3), summary["layouts"]
    assert first["pp"] in (1, 2) and last["from_step"] == first["to_step"] - summary["restarts"][0]["steps_redone"] + 1
    assert summary["restarts"][0]["step"] == GROWTH_HOLD, summary["restarts"]   # the held group trained no further
    assert_exactly_once(run, data_cache)
    assert_resumed_like_reference(run, summary, reference)
