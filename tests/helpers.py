"""What several test files need: gloo process groups (spawned here or under torchrun) and stopping processes.
The sample-id ledger is read back by raydl.data.ledger_read.

Waiting with a deadline and signalling a process are raydl's own, shared with the benchmarks:
raydl.bench.fault_cluster.poll and raydl.bench.procs.kill.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raydl.bench.fault_cluster import poll
from raydl.bench.procs import free_port, kill
from raydl.worker import main as worker_main

REPO = Path(__file__).resolve().parents[1]
# run_gloo's ranks are forked from one server process per test process that imported these once: a spawned rank
# imported them itself, 2-6 CPU-s each (torch, DCP, transformers' Llama pulls torchao in), and the suite is CPU-bound.
multiprocessing.set_forkserver_preload(["tests.helpers", "raydl.worker", "torch.distributed.checkpoint",
                                        "transformers.models.llama.modeling_llama",
                                        "transformers.models.gpt2.modeling_gpt2", "peft"])


# ------------------------------------------------------------------------------------------------- gloo
def _gloo_entry(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():   # the code under test may have closed it itself
            dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args) -> None:
    """Run fn(rank, world_size, *args) in `world_size` processes forked from the preloaded server, with a gloo group.

    fn must be importable (module level); results go through files in a tmp dir. The ranks inherit the environment
    of the first call's time (the fork server's), not the caller's at a later call.
    """
    mp.start_processes(_gloo_entry, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       start_method="forkserver", join=True)


def _worker_rank(rank: int, world_size: int, argv: list[str]) -> None:
    code = worker_main(argv)
    if code:
        raise SystemExit(f"rank {rank}: python -m raydl.worker exited {code}")


def forked_worker(nproc: int, run_dir: Path, overrides: list[str]) -> None:
    """raydl's per-worker loop (`python -m raydl.worker`'s main) in `nproc` forked gloo ranks (run_gloo): the process
    group and ranks torchrun would give it, without a torchrun agent and a start of each rank (~10 CPU-s)."""
    run_gloo(_worker_rank, nproc, ["--run-dir", str(run_dir), *(a for s in overrides for a in ("--set", s))])


def torchrun_worker(nproc: int, run_dir: Path, overrides: list[str], *, timeout_s: float,
                    resume: Path | None = None) -> subprocess.CompletedProcess:
    """raydl's per-worker loop (raydl.worker) under torchrun: `nproc` gloo ranks, no Ray; `resume`: a run
    directory or checkpoint to start from (a changed config needs a new run directory).

    The ranks inherit this process's env (OMP_NUM_THREADS as conftest.py set it), as Ray's workers do."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "raydl.worker", "--run-dir", str(run_dir), *(a for s in overrides for a in ("--set", s)),
           *(["--resume", str(resume)] if resume else [])]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)


def engine_on_this_rank(cfg, meta: dict, rank: int, world_size: int):
    """(engine, layout): the training engine raydl's loop builds for `rank` of a gloo group (run_gloo), from `cfg`
    and the dataset's `meta`, without the loop around it: one step of a test feeds it batches by hand."""
    from types import SimpleNamespace

    from raydl.models.choice import choose_model
    from raydl.parallel.mesh import build_mesh, layout_for
    from raydl.train.engines import DataParallelEngine, PipelineEngine
    from raydl.train.model_build import build_for_worker

    chosen = choose_model(cfg.model)
    built, init = build_for_worker(chosen, meta, cfg)
    layout = layout_for(cfg, world_size, num_blocks=len(built.blocks))
    mesh = build_mesh(layout, "cpu") if world_size > 1 else None
    session = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
    engine = (PipelineEngine if layout.pp > 1 else DataParallelEngine)(built, layout, cfg, chosen.spec, session,
                                                                        mesh, init)
    return engine, layout


# ------------------------------------------------------------------------------------------------- processes
def stop_processes(pids: list[int], grace_s: float = 15) -> None:
    """SIGTERM each of `pids`, then SIGKILL those still alive after `grace_s`."""
    for pid in pids:
        kill(pid, signal.SIGTERM)
    try:
        poll(f"{len(pids)} processes exiting on SIGTERM", lambda: not any(kill(pid, 0) for pid in pids), grace_s,
             every_s=0.5)
    except TimeoutError:
        for pid in pids:
            kill(pid, signal.SIGKILL)


RAYDL_LINE = re.compile(r"(\[raydl\] |raydl: error: |raydl: interrupted$)")


def not_raydls(console: str) -> list[str]:
    """The lines of a console (stderr, or stdout and stderr as a terminal interleaves them) that raydl did not
    write: anything but its logger's lines, its error paragraph and the summary JSON; and any line with a colour
    code, Ray's "(... pid=...)" prefix or a traceback (issue 35: one voice on the console)."""
    lines = console.splitlines()
    if "{" in lines and "}" in lines[lines.index("{"):]:   # the summary JSON (stdout)
        start = lines.index("{")
        end = lines.index("}", start)
        lines = lines[:start] + lines[end + 1:]
    return [line for line in lines if line.strip() and (not RAYDL_LINE.match(line) or "\x1b[" in line
                                                        or "pid=" in line or "Traceback" in line)]


# ------------------------------------------------------------------------------------------------- raydl's log
@contextlib.contextmanager
def raydl_warns(match: str = ""):
    """Asserts that raydl's logger warned, a message matching `match` (a regex), inside the block."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("raydl").addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger("raydl").removeHandler(handler)
    assert any(re.search(match, r.getMessage()) for r in records), [r.getMessage() for r in records]
