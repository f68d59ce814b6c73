"""Restart from memory (issue 25, point 5): a pipeline run (pp=2), an FSDP or a DDP run (dp=2) whose worker is SIGKILLed
restarts its whole worker group, which reloads the last step from the run's state holder instead of the last
storage checkpoint; when the ranks' held states disagree, from storage (the pipeline run's first fault).

On the fault cluster of tests/ray/test_faults.py (a 1-CPU head and one 1-CPU worker node; one Train worker per
node), tiny GPT on the built-in task, one epoch of 60 steps, checkpoint.every_steps=100 (no storage checkpoint
before the end), telemetry.report_every=1 (every step's record reaches metrics.jsonl, so the steps redone are
counted exactly). Each test checks the exactly-once ledger and the result against the fault-free run (raydl's loop in
forked gloo ranks).

    RAY_TMPDIR=/tmp/ray-$USER pytest tests/ray/test_restart_from_memory.py -s
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from raydl.bench.fault_cluster import FaultCluster
from raydl.bench.procs import kill
from tests.ray.fault_harness import ledger_run, reference_run
from tests.ray.test_faults import assert_exactly_once, log

pytestmark = [pytest.mark.slow]

GB, STEPS = 64, 60
PP2 = ("parallel.pp_degree=2", "parallel.num_microbatches=2")
FSDP2 = ("parallel.dp_wrapper=fsdp",)
DDP2 = ("parallel.dp_wrapper=ddp",)   # replicas: rank 0 alone sends, rank 1 reloads rank 0's copy


def overrides(data_cache, *extra: str, layout=PP2) -> list[str]:
    return [f"data.cache_dir={data_cache}", "data.builtin_samples=4096", f"train.global_batch_size={GB}",
            f"train.max_steps={STEPS}", "telemetry.report_every=1", "train.eval_batches=2",
            "telemetry.progress=false", "scaling.min_workers=2", "scaling.max_workers=2", "scaling.max_failures=2",
            "checkpoint.memory_every_steps=1", *layout, *extra,
            "scaling.survivors=off"]   # ddp_dp2 too: a restart of the whole group (the survivors': test_survivors.py)


@pytest.fixture(scope="module")
def cluster():
    c = FaultCluster()
    c.resize(1)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def reference(data_cache, tmp_path_factory):
    """reference(layout) -> the fault-free run of that layout (forked gloo ranks), cached: it saves no checkpoint before
    its end whatever the test's checkpoint.every_steps (fault_harness.reference_run), so one serves every test of a layout."""
    cache: dict[tuple, dict] = {}

    def of(layout: tuple[str, ...]) -> dict:
        if layout not in cache:
            cache[layout] = reference_run(tmp_path_factory.mktemp("reference") / "run", overrides(data_cache, layout=layout))
        return cache[layout]
    return of


def same_as_reference(run, summary: dict, reference: dict) -> None:
    """Same layout before and after the restart: every step's loss, the final loss and the eval bit-identical."""
    assert summary["steps"] == reference["steps"] and summary["samples"] == reference["samples"]
    for r in run.records():
        assert r["loss"] == reference["losses"][r["step"]], (r["step"], r["loss"], reference["losses"][r["step"]])
    assert summary["final_loss"] == reference["final_loss"] and summary["eval"] == reference["eval"]


@pytest.mark.parametrize("layout", [FSDP2, DDP2], ids=["fsdp_dp2", "ddp_dp2"])   # pp2: the next test
def test_worker_kill_redoes_at_most_one_step(cluster, data_cache, tmp_path, layout, reference):
    sets = overrides(data_cache, "checkpoint.every_steps=100", layout=layout)
    run = ledger_run(tmp_path / "faulted", sets, cluster.address).start()
    try:
        run.wait_step(30, deadline_s=400)
        assert kill(random.Random(0).choice(run.workers(2)))
        fault_after = run.step()
        summary = run.finish(deadline_s=400)
    finally:
        run.stop()
    (restart,) = summary["restarts"]
    log(f"killed after step {fault_after}: {restart}")
    assert restart["resumed_at_step"] >= fault_after - 1 and restart["steps_redone"] <= 1, restart
    assert "resumed from memory at step" in run.tail(200_000)
    assert_exactly_once(run, data_cache)
    same_as_reference(run, summary, reference(layout))


def test_restart_reads_storage_when_the_ranks_held_states_disagree_and_memory_after_a_kill(cluster, data_cache,
                                                                                           tmp_path, reference):
    """Two faults in one pipeline run. First rank 1's shards are taken out of the holder while the workers are
    stopped, and the stopped group's later sends refused: no step is held by every rank, so the restarted group
    reloads the last storage checkpoint (every 10 steps here) instead. Then a worker is SIGKILLed past step 45, away
    from a storage checkpoint: the restarted group reloads the last step from the holder, redoing at most one."""
    run = ledger_run(tmp_path / "faulted", overrides(data_cache, "checkpoint.every_steps=10"), cluster.address).start()
    try:
        run.wait_step(25, deadline_s=400)
        workers = run.workers(2)
        for pid in workers:
            kill(pid, signal.SIGSTOP)
        held = drop_rank_from_holder(cluster.address, rank=1)
        assert held, "the holder held no step of rank 1"
        fault_after = run.step()
        kill(workers[1])
        kill(workers[0], signal.SIGCONT)
        run.wait_step(45, deadline_s=400)
        console_before_the_kill = run.tail(200_000)
        assert kill(random.Random(0).choice(run.workers(2)))
        kill_after = run.step()
        summary = run.finish(deadline_s=400)
    finally:
        run.stop()
    from_storage, from_memory = summary["restarts"]
    log(f"killed after step {fault_after} with rank 1's held steps {held} dropped: {from_storage}")
    log(f"killed after step {kill_after}: {from_memory}")
    # The storage checkpoint, not a held step; every step since it redone. The last step may be one past
    # `fault_after`: a step done before the SIGSTOP whose record reached the driver after it (as in CI once).
    assert from_storage["resumed_at_step"] == 20 and from_storage["step"] in (fault_after, fault_after + 1), from_storage
    assert from_storage["steps_redone"] == from_storage["step"] - 20, from_storage
    assert "resumed from memory" not in console_before_the_kill
    assert from_memory["resumed_at_step"] >= kill_after - 1 and from_memory["steps_redone"] <= 1, from_memory
    assert "resumed from memory at step" in run.tail(200_000)
    assert_exactly_once(run, data_cache)
    same_as_reference(run, summary, reference(PP2))


def drop_rank_from_holder(address: str, *, rank: int) -> list[str]:
    """Take `rank`'s shards out of the run's state holder (in a client process of its own: this one runs the
    cluster); returns the held entries that had it. The holder's generation moves on too, as at a new worker
    group's start, so that it refuses the stopped group's sends: a rank's shard sent just before the SIGSTOP
    (from its sender thread, not waited for) may reach the holder after this drop and complete a newer step
    (CI once resumed at step 26, held by both ranks after rank 1's 25 was dropped)."""
    code = textwrap.dedent(f"""
        import json, ray
        ray.init(address={address!r}, logging_level="ERROR")
        (found,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("raydl-state-")]
        holder = ray.get_actor(found["name"], namespace=found["namespace"])
        def drop(h):
            had = [f"{{g}}/{{s}}" for (g, s), e in h.entries.items() if {rank} in e["ranks"]]
            for e in h.entries.values():
                e["ranks"].pop({rank}, None)
            h.generation += 1
            return had
        print(json.dumps(ray.get(holder.__ray_call__.remote(drop))))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
