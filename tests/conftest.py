"""Shared fixtures: one Ray instance per test session, tiny configs (helpers: tests/helpers.py).

Environment set here (and in .ci/run): one thread per process, bf16 allowed on this VM's
CPU (oneDNN capped below AMX, see shared/PIPELINE_NOTES.md 0), Ray kept in its own temp dir.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
# Each test process its own Ray temp dir (Ray's "auto" reads the last cluster there), removed when the process ends
# (pytest_unconfigure): left behind, every run's Ray logs and spilled objects stayed on the machine's disk.
MADE_RAY_TMPDIR = None
if os.environ.get("PYTEST_XDIST_WORKER") or "RAY_TMPDIR" not in os.environ:
    MADE_RAY_TMPDIR = tempfile.mkdtemp(prefix=f"raydl-ray-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
    os.environ["RAY_TMPDIR"] = MADE_RAY_TMPDIR
os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray"), exist_ok=True)
os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
# Ray refuses to spill objects, and every raylet prints an error on every driver's console each 10 s, once the disk
# of its temp dir is 95% full (Ray's local_fs_capacity_threshold): on CI's 252 GB disk that is 12.6 GB still free,
# and stop 48's CI failed three tests with 8.1 GB free (an OutOfDiskError spilling 157 MB; the raylet's line in two
# commands' stderr). The suite's Rays need far less than the 2.5 GB that 99% leaves.
os.environ.setdefault("RAY_local_fs_capacity_threshold", "0.99")
# An idle Ray costs CPU: the session Ray of each test process idled at 7.1% of a core, 4.2% with these (cgroup, 60 s,
# quiet, 2026-12-06), and the suite keeps two alive for its whole run besides its private Rays and clusters. Nothing
# in the suite reads what they turn off: Ray's metrics (its Prometheus export; raydl records its own metrics), the
# dashboard agent's per-process stats every 5 s, two idle workers prestarted for the session's driver (never used:
# every run's actors ask for their own runtime env), and the log monitor's glob of the whole logs directory every
# 0.1 s (a stat per file, which grows with every worker that ever ran), now once a second. A new worker's log file is
# still found within a second of its start and read from its first line.
for knob, value in (("RAY_enable_metrics_collection", "0"), ("REPORTER_UPDATE_INTERVAL_MS", "60000"),
                    ("RAY_prestart_worker_first_driver", "0"), ("RAY_enable_worker_prestart", "0"),
                    ("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0"), ("LOG_NAME_UPDATE_INTERVAL_S", "1")):
    os.environ.setdefault(knob, value)
# Ray starts its workers and actors at nice 15 (its worker_niceness), so that on a shared node they yield to its
# daemons. Here they yield to every other process of the suite (the other test process's torchrun and gloo ranks,
# commands, the test processes) and to anything beside it: with a process burning a core beside two of its modules,
# that process kept a whole core and the runs' workers shared what was left (164.5 s wall; 117.2 s with the workers at
# nice 0; quiet 83.6 and 87.3 s: one run each, 2026-12-06). The Rays the tests start run them at 0, as Ray's job
# drivers already are.
os.environ.setdefault("RAY_worker_niceness", "0")
# Where the shell sets PYTHONDONTWRITEBYTECODE (this workplace's does), every process the tests start (each Ray worker
# and actor, each `raydl` and torchrun rank) compiled raydl's modules again: a Train worker's imports took 2.9-3.1
# CPU-s so, 2.7 from the compiled files (2026-11-29), and the suite starts hundreds of such processes.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


# The Ray and gloo modules handed out longest first (CPU-s by cgroup, 2026-12-06), so that no process is left with a long
# one at the end while the other waits: the rest in collection order after them, then the unit tests, short ones that
# even out the two processes' ends.
LONGEST_FIRST = ("test_faults", "test_survivors", "test_docs", "test_restart_from_memory", "test_s3_e2e",
                 "test_late_start", "test_console", "test_data_ledger", "test_train_e2e", "test_stop", "test_jobs_submit",
                 "test_own_model")


def pytest_collection_modifyitems(items):
    """Under xdist (--dist loadfile, --no-loadscope-reorder) a module's tests stay in one process (its module-scoped
    cluster, job server or references are built once), handed out in this order."""
    unit = [i for i in items if i.path.parent.name == "unit"]
    other = [i for i in items if i.path.parent.name != "unit"]
    other.sort(key=lambda i: LONGEST_FIRST.index(i.path.stem) if i.path.stem in LONGEST_FIRST else len(LONGEST_FIRST))
    items[:] = other + unit


def pytest_addoption(parser):
    parser.addoption("--cpu-top", type=int, default=30,
                     help="print the N tests that used the most CPU (tests/cpu_watch.py)")


def pytest_configure(config):
    from tests.cpu_watch import join_own_cgroup

    join_own_cgroup()


def pytest_unconfigure(config):
    if MADE_RAY_TMPDIR:   # after the session's fixtures, the session Ray's shutdown among them
        import shutil

        shutil.rmtree(MADE_RAY_TMPDIR, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    from tests.cpu_watch import watch

    item.cpu_watch = watch()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and hasattr(item, "cpu_watch"):   # the test's setup, call and teardown
        from tests.cpu_watch import KEY

        outcome.get_result().user_properties.append((KEY, item.cpu_watch.stop()))


@pytest.hookimpl(trylast=True)   # after pytest's durations
def pytest_terminal_summary(terminalreporter, config):
    from tests.cpu_watch import summary_lines

    reports = [r for kind in terminalreporter.stats.values() for r in kind if getattr(r, "when", "") == "teardown"]
    for line in summary_lines(reports, config.getoption("--cpu-top")):
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """Built-in datasets are generated once per session and shared by all tests."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture
def tiny_overrides(data_cache, tmp_path) -> list[str]:
    """Overrides for a fast run of the default model in a fresh runs dir."""
    return [f"data.cache_dir={data_cache}", f"run.runs_dir={tmp_path / 'runs'}", "train.max_steps=20",
            "telemetry.report_every=10", "checkpoint.every_steps=10", "data.builtin_samples=4096",
            "train.eval_batches=2", "telemetry.progress=false"]


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (ray.init costs ~7 s here)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {
        k: os.environ[k] for k in ("OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA")}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def shared_ray_address(ray_session) -> str:
    """The session's Ray for `raydl` subprocesses (RAY_ADDRESS or --address): a private Ray per command costs 6 s on
    a quiet 2-core machine and 25 s on a busy one. What differs on a private Ray (the README's default path, Ctrl-C,
    late start, the printed commands of a local run) is tested on one."""
    return ray_session.get_runtime_context().gcs_address


@pytest.fixture
def on_shared_ray(shared_ray_address, monkeypatch) -> str:
    """The `raydl` commands this test starts join the session's Ray through RAY_ADDRESS, as a user's shell may set it."""
    monkeypatch.setenv("RAY_ADDRESS", shared_ray_address)
    return shared_ray_address


@pytest.fixture
def s3_bucket(monkeypatch) -> str:
    """A fresh bucket on a real S3 server (moto's, on loopback) for one test: returns "s3://<bucket>".
    The AWS_* env vars point pyarrow (raydl's and Ray's), boto3 and every process started from here at it."""
    from tests.s3 import S3Server

    with S3Server() as server:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        yield server.new_bucket()
