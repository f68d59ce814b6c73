"""raydl train: train on Ray Train (local Ray sized to this machine, or --address)."""

from __future__ import annotations

import json

from raydl.cli import output
from raydl.cli.common import add_config_args, parser_kwargs


def register(sub) -> None:
    p = sub.add_parser("train", **parser_kwargs("Train a model with elastic data/pipeline parallelism on Ray."))
    add_config_args(p)
    p.add_argument("--address", help="Ray cluster to use (e.g. auto, ray://host:10001); default: RAY_ADDRESS when it names a cluster (as ray.init reads it), else a private local Ray.")
    p.add_argument("--resume", metavar="RUN_DIR_OR_CHECKPOINT", help="Continue a run from its newest checkpoint, in "
                   "a new run directory: the run's config.yaml is the base that --config and --set change (each "
                   "changed field is named at start; one the checkpoint cannot take is refused).")
    p.set_defaults(func=run)


def run(args) -> int:
    from raydl import api

    summary = api.train(args.config, overrides=args.overrides, address=args.address, resume=args.resume)
    print(json.dumps(summary, indent=1), file=output.result())
    signum = summary.get("stopped_by_signal", 0)
    return 128 + signum if signum else 0
