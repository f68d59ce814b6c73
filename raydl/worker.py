"""Run the per-worker loop without Ray, under torchrun (same config, same checkpoints).

    torchrun --standalone --nproc-per-node 2 -m raydl.worker --config my.yaml --run-dir runs/debug
    torchrun --nproc-per-node 1 -m raydl.worker --set model.size=gpt2 --set train.precision=bf16

A run directory that already has checkpoints is resumed from its latest one, which is what
torchrun's own restarts (--max-restarts) need.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from raydl.data.dataset import check_task, open_dataset, resolve_path
from raydl.errors import RaydlError
from raydl.models.registry import get_spec
from raydl.overrides import dump_yaml, load_config
from raydl.train.loop import train_worker


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raydl.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--run-dir", help="Run directory (default runs/<run.name>-torchrun).")
    p.add_argument("--resume", help="Checkpoint to start from when the run directory has none.")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        spec = get_spec(cfg.model)
        data_path = resolve_path(cfg, spec.task)       # race-safe: every rank may call it
        check_task(open_dataset(data_path), spec.task, spec.name)
    except RaydlError as e:
        print(f"raydl: error: {e}", file=sys.stderr)
        return e.exit_code
    run_dir = Path(args.run_dir or Path(cfg.run.runs_dir) / f"{cfg.run.name}-torchrun").resolve()
    if int(os.environ.get("RANK", 0)) == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    try:
        train_worker({"config": cfg.to_dict(), "data_path": str(Path(data_path).resolve()),
                      "run_dir": str(run_dir), "resume_from": args.resume})
    except RaydlError as e:   # found mid-run (a corrupt shard, an unusable checkpoint): the last checkpoint stays
        print(f"raydl: error: {e}", file=sys.stderr)
        return e.exit_code
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(json.loads((run_dir / "summary.json").read_text()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
