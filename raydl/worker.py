"""Run the per-worker loop without Ray, under torchrun (same config, same checkpoints).

    torchrun --standalone --nproc-per-node 2 -m raydl.worker --config my.yaml --run-dir runs/debug
    torchrun --nproc-per-node 1 -m raydl.worker --set model.size=gpt2 --set train.precision=bf16
    python -m raydl.worker --set train.max_steps=100          # one process, no torchrun, no process group

A run directory that already has checkpoints is resumed from its latest one, which is what
torchrun's own restarts (--max-restarts) need.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from raydl import log as raydl_log
from raydl.cli import add_verbosity_args
from raydl.driver.prepare import prepare_run
from raydl.errors import RaydlError, say
from raydl.driver.resume import resumed_tree
from raydl.overrides import apply_overrides, build_config, read_yaml
from raydl.telemetry.profiler import print_table
from raydl.train.loop import train_worker

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raydl.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--run-dir", help="Run directory (default runs/<run.name>-torchrun); one holding another "
                   "config is refused.")
    p.add_argument("--resume", help="Run directory or checkpoint to start from when the run directory has none; its "
                   "run's config.yaml is the base that --config and --set change.")
    add_verbosity_args(p, default=None)   # None: RAYDL_VERBOSITY, as a launcher may set it for every rank
    args = p.parse_args(argv)
    raydl_log.configure(args.verbosity)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        tree = read_yaml(args.config) if args.config else {}
        if args.resume:   # the run's own config is the base (raydl.driver.resume)
            tree = resumed_tree(args.resume, tree)
        cfg = build_config(apply_overrides(tree, args.overrides))
        run = prepare_run(cfg, resume=args.resume, launcher="torchrun", write=rank0,
                          run_dir=args.run_dir or Path(cfg.run.runs_dir) / f"{cfg.run.name}-torchrun")
        train_worker(run.job)
    except RaydlError as e:   # bad input, or found mid-run (a corrupt shard): the last checkpoint stays
        return say(e)
    summary = json.loads((run.run_dir / "summary.json").read_text()) if rank0 else {}
    if rank0:
        print_table(run.run_dir)
        print(json.dumps(summary, indent=1))
    signum = summary.get("stopped_by_signal", 0)
    if signum:
        log.warning(f"stopped at step {summary['steps']} with checkpoint {summary['checkpoint']}; rerun the same "
                    f"command to resume")
    return 128 + signum if signum else 0


if __name__ == "__main__":
    sys.exit(main())
