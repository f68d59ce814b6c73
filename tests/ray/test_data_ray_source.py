"""data.backend=ray reads the same rows, in the same order, at the same positions as the arrow
backend (tokens), applies the same augmentation through map_batches (images), names a corrupt
shard (unreadable, or failing its checksum) as the arrow backend does, and streams a dataset larger than the object store."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import ray

from raydl.config import JobConfig
from raydl.data import ray_source
from raydl.data.dataset import ensure_builtin, open_dataset
from raydl.data.loader import StepLoader
from raydl.data.order import DataPosition
from raydl.errors import DataError
from tests.unit.test_data_loader import corrupt, flip_a_byte_silently, make_dataset

pytestmark = pytest.mark.slow


def steps(path, backend: str, dp_rank: int, position: DataPosition, n: int, column: str = "input_ids") -> list:
    """The first `n` steps, from a loader of `n` steps read to its end."""
    loader = StepLoader(open_dataset(str(path)), global_batch=64, dp_rank=dp_rank, dp_size=2, seed=3, shuffle=True,
                        position=position, prefetch=2, backend=backend, augment=True, steps=n)
    return [(b.position, b.tensors["id"].tolist(), b.tensors[column].double().sum().item()) for b in loader]


@pytest.fixture
def cancels(monkeypatch) -> list:
    """Every ray.cancel of this process (Ray Data cancels the read tasks still running when an execution is
    closed), passed on to Ray."""
    calls, cancel = [], ray.cancel

    def counted(*args, **kwargs):
        calls.append(args)
        return cancel(*args, **kwargs)

    monkeypatch.setattr(ray, "cancel", counted)
    return calls


@pytest.mark.parametrize("reads_per_execution", [1, ray_source.READS_PER_EXECUTION])
def test_a_loader_of_n_steps_runs_each_execution_to_its_end_and_cancels_no_read(ray_session, tmp_path, cancels,
                                                                                 monkeypatch, reads_per_execution):
    """A cancel that races a read task's completion aborted the process in Ray 2.60's core worker (CI, once):
    a loader that knows its steps lets every execution end by itself, the last one at its last step.
    1 read per execution: an execution per epoch (two here); the default: one execution of 16k steps."""
    monkeypatch.setattr(ray_source, "READS_PER_EXECUTION", reads_per_execution)
    path = make_dataset(tmp_path)
    start = DataPosition(0, 5 * 64)
    ray_steps = steps(path, "ray", 1, start, 40)
    assert cancels == []
    assert ray_steps == steps(path, "arrow", 1, start, 40)       # 40 steps, into the second epoch, as arrow's
    assert len(ray_steps) == 40 and ray_steps[-1][0] == DataPosition(1, 13 * 64)


def test_a_loader_closed_before_its_end_cancels_its_reads(ray_session, tmp_path, cancels):
    """What the test above guards against happens: an execution closed at step 40 of its 16k cancels the reads
    it had started (Ray Data kills their workers: force=True)."""
    loader = StepLoader(open_dataset(str(make_dataset(tmp_path))), global_batch=64, dp_rank=1, dp_size=2, seed=3,
                        shuffle=True, position=DataPosition(0, 5 * 64), prefetch=2, backend="ray")
    batches = iter(loader)
    for _ in range(40):
        next(batches)
    batches.close()
    assert cancels


def test_ray_backend_matches_arrow_from_a_mid_epoch_position(ray_session, tmp_path):
    path = make_dataset(tmp_path)                     # 2048 rows, 32 steps per epoch
    start = DataPosition(0, 20 * 64)                  # resume mid-epoch, run into the next epoch
    for rank in (0, 1):
        assert steps(path, "ray", rank, start, 16) == steps(path, "arrow", rank, start, 16)


@pytest.mark.parametrize("damage", ["truncated", "one byte changed"])
def test_ray_backend_names_a_corrupt_shard(ray_session, tmp_path, damage):
    path = make_dataset(tmp_path)
    bad = path / "train-00001.parquet"
    if damage == "truncated":
        corrupt(path, 1)
    else:
        flip_a_byte_silently(bad)
    with pytest.raises(DataError, match=rf"^shard '{bad}'.*Fix:") as e:
        steps(path, "ray", 0, DataPosition(0, 0), 32)
    assert "RayTaskError" not in str(e.value) and "Traceback" not in str(e.value)
    assert damage == "truncated" or "sha256" in str(e.value)       # the read task checked the checksum


def test_ray_backend_augments_images_like_arrow(ray_session, tmp_path):
    cfg = JobConfig()
    cfg.data.cache_dir, cfg.data.builtin_samples, cfg.data.shard_rows = str(tmp_path), 1200, 512
    path = ensure_builtin(cfg, "images")              # 1125 train rows: 17 steps of 64 per epoch
    start = DataPosition(0, 10 * 64)
    ray_steps = steps(path, "ray", 1, start, 10, column="image")
    assert ray_steps == steps(path, "arrow", 1, start, 10, column="image")
    assert ray_steps[7][0].epoch == 1                 # crossed into an epoch with a new augmentation


def test_dataset_larger_than_the_object_store_streams_through(tmp_path):
    """157 MB of token rows through a Ray whose object store holds 80 MiB: every row once, and the
    consumer's private memory flat after Ray Data's start-up."""
    from raydl.bench.ingest import make_dataset as token_rows

    path = token_rows(tmp_path, 38400, 512)
    script = textwrap.dedent(f"""
        import json, os, ray
        from raydl.data.dataset import open_dataset
        from raydl.data.loader import StepLoader
        from raydl.data.order import DataPosition

        def rss():     # resident minus shared pages: the object store's mapped blocks are not this process's
            resident, shared = map(int, open("/proc/self/statm").read().split()[1:3])
            return (resident - shared) * os.sysconf("SC_PAGE_SIZE")

        ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False)
        store = ray.cluster_resources()["object_store_memory"]
        loader = StepLoader(open_dataset({str(path)!r}), global_batch=256, dp_rank=0, dp_size=1, seed=0,
                            shuffle=True, position=DataPosition(0, 0), prefetch=2, backend="ray", steps=150)
        ids, nbytes, memory = [], 0, []
        for batch in loader:
            ids += batch.tensors["id"].tolist()
            nbytes += sum(t.numel() * t.element_size() for t in batch.tensors.values())
            memory.append(rss())
        warm = len(memory) // 4     # after Ray Data's own start-up (imports, executor, first blocks)
        print(json.dumps({{"store": store, "bytes": nbytes, "rows": len(ids), "distinct": len(set(ids)),
                          "startup": memory[warm] - memory[0], "growth": max(memory[warm:]) - memory[warm]}}))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    # A native abort prints a stack of frames: show what it said above them, and whether the loop had finished.
    said = [line for line in p.stderr.splitlines() if line.strip() and not line.lstrip().startswith("/")]
    assert p.returncode == 0, "\n".join([*said[-30:], "stdout:", p.stdout[-500:]])
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(r)
    assert r["bytes"] > 1.8 * r["store"]                            # the data does not fit in the store
    assert r["rows"] == r["distinct"] == 38400                      # and every row came through once
    assert r["growth"] < r["bytes"] / 10                            # without the consumer holding on to it
