"""raydl bench startup: where the time from `raydl train` to its first finished step goes, cold and warm.

    raydl bench startup --repeats 5 --warm
    raydl bench startup --repeats 5 --warm --set data.backend=ray      # overrides for every run

Runs the default `raydl train` as a user does (a subprocess; only train.max_steps and run.dir set) and reads
the start-up phases from its summary.json (raydl.telemetry.startup): `cold` starts its own private Ray;
with --warm, `warm` runs alternate with them on a Ray head that this benchmark starts once (`ray start --head`
in a private temp dir, joined with --address auto) and stops at the end. Prints each phase's median with its
spread and the command -> first step total against issue 15's goals (15 s cold, 8 s warm).
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raydl.bench import harness
from raydl.bench.fault_cluster import poll
from raydl.bench.procs import free_port
from raydl.telemetry.startup import ORDER

GOALS_S = {"cold": 15.0, "warm": 8.0}
BIN = Path(sys.executable).parent   # this environment's raydl and ray
# Another Ray of this machine must neither be joined nor be pointed at this benchmark's (RAY_NOTES P9).
OUTSIDE_RAY = ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_TMPDIR")


@dataclass
class Head:
    proc: subprocess.Popen
    env: dict[str, str]     # what a client needs to find and join it with --address auto


def private_env(ray_tmp: Path, **extra: str) -> dict[str, str]:
    (ray_tmp / "ray").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in OUTSIDE_RAY}
    return {**env, "PATH": f"{BIN}:{env.get('PATH', '')}", "RAY_TMPDIR": str(ray_tmp), **extra}


def start_head(ray_tmp: Path) -> Head:
    """`ray start --head --block` on free ports with a token of its own, ready when it says it started and
    wrote the address file that --address auto reads (without it, auto would look in /tmp/ray: someone else's)."""
    env = private_env(ray_tmp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
                      RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="1")   # nothing to drain at the end
    log = ray_tmp / "head.log"
    # Fixed default ports (agent, client server...) collide with other Rays on a shared machine.
    ports = [f"--{name}={free_port()}" for name in ("port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                     "ray-client-server-port", "metrics-export-port",
                                                     "runtime-env-agent-port")]
    with log.open("w") as out:
        proc = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", "--include-dashboard=false",
                                 f"--temp-dir={ray_tmp / 'ray'}", "--disable-usage-stats", *ports],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    head = Head(proc, env)
    try:
        poll("ray start --head", lambda: _head_started(head, log), 120, lambda: log.read_text()[-3000:], every_s=0.5)
    except BaseException:
        stop_head(head)
        raise
    return head


def _head_started(head: Head, log: Path) -> bool:
    if head.proc.poll() is not None:
        raise RuntimeError(f"ray start exited with {head.proc.returncode}:\n{log.read_text()[-3000:]}")
    return "Ray runtime started" in log.read_text() and (log.parent / "ray" / "ray_current_cluster").exists()


def stop_head(head: Head) -> None:
    head.proc.terminate()   # `ray start --block` stops its node on SIGTERM
    try:
        head.proc.wait(60)
    except subprocess.TimeoutExpired:
        head.proc.kill()
        head.proc.wait()


def train_once(run_dir: Path, env: dict[str, str], args: list[str], overrides: list[str], steps: int) -> dict[str, Any]:
    """One `raydl train`: its start-up phases (seconds) and the command's wall time."""
    sets = [f"train.max_steps={steps}", f"run.dir={run_dir}", *overrides]
    command = [str(BIN / "raydl"), "train", *args, *(a for s in sets for a in ("--set", s))]
    t0 = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.time() - t0
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    startup = json.loads((run_dir / "summary.json").read_text())["startup"]
    return {"to_first_step_s": startup["to_first_step_s"], "command_wall_s": wall,
            **{f"phase:{name}": seconds for name, seconds in startup["phase_s"].items()}}


def report(side: str, stats: dict[str, dict[str, Any]]) -> str:
    rows = [f"{side}: phase (ends at)            median s   min     max   spread"]
    for name in ORDER[1:]:
        if s := stats.get(f"phase:{name}"):
            spread = "" if s["spread"] is None else f"{100 * s['spread']:5.0f}%"
            rows.append(f"  {name:28s} {s['median']:8.2f} {s['min']:7.2f} {s['max']:7.2f} {spread}")
    total, goal = stats["to_first_step_s"], GOALS_S[side]
    rows.append(f"  command -> first step: {harness.describe('total', total, ' s')}; goal <= {goal:g} s: "
                f"{'met' if total['median'] <= goal else 'NOT met'}")
    rows.append(f"  {harness.describe('command wall (to exit)', stats['command_wall_s'], ' s')}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("startup", __doc__)
    p.add_argument("--steps", type=int, default=5, help="train.max_steps of every run (start-up is what counts).")
    p.add_argument("--warm", action="store_true", help="Also runs on a Ray head that is already up (--address auto).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Config overrides for every run.")
    args = harness.parse_args(p, argv)
    session = harness.Session("startup", args)
    work = Path(tempfile.mkdtemp(prefix="rdlsu", dir="/tmp"))   # short: Ray's socket paths are capped at 107 bytes
    run_numbers = itertools.count()

    def side(env: dict[str, str], *cli: str):
        return lambda: train_once(work / f"run{next(run_numbers)}", env, list(cli), args.overrides, args.steps)

    sides = {"cold": side(private_env(work / "cold"))}
    head = start_head(work / "warm") if args.warm else None
    try:
        if head:
            sides["warm"] = side(head.env, "--address", "auto")
        runs_by_side = harness.alternate(sides, args.repeats)
    finally:
        if head:
            stop_head(head)
    stats = {name: harness.summarize(side_runs) for name, side_runs in runs_by_side.items()}
    for name, side_stats in stats.items():
        print(report(name, side_stats))
    session.write(steps=args.steps, goals_s=GOALS_S, sides=stats)
    shutil.rmtree(work, ignore_errors=True)
    return 0
