"""raydl profile: a short `raydl train` that profiles a few steps after warm-up and says where each rank's time goes.

    raydl profile --steps 3 --set parallel.pp_degree=2           # traces + breakdown in runs/<run>/profile/

Under torchrun, the same with `python -m raydl.worker --set telemetry.profile_steps=3`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from raydl.cli.common import add_config_args, parser_kwargs
from raydl.errors import ConfigError

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("profile", **parser_kwargs(
        "Profile a few training steps on Ray: a Chrome trace per rank and where each rank's step time goes "
        "(forward, backward, collectives, pipeline send/recv and bubble, optimizer, data wait; top ops)."))
    add_config_args(p)
    p.add_argument("--steps", type=int, default=3, help="Steps to profile after the warm-up (default 3).")
    p.add_argument("--address", help="Ray cluster to use (e.g. auto, ray://host:10001); default: RAY_ADDRESS when it names a cluster (as ray.init reads it), else a private local Ray.")
    p.set_defaults(func=run)


def run(args) -> int:
    from raydl import api
    from raydl.telemetry.profiler import BREAKDOWN_FILE, PROFILE_DIR, WARMUP_STEPS, print_table

    if args.steps < 1:
        raise ConfigError("--steps", f"is {args.steps}", "profile at least one step: --steps 3")
    overrides = [*args.overrides, f"telemetry.profile_steps={args.steps}",
                 f"train.max_steps={WARMUP_STEPS + args.steps}"]
    summary = api.train(args.config, overrides=overrides, address=args.address)
    if summary.get("stopped_by_signal"):
        return 128 + summary["stopped_by_signal"]   # stopped before the profile was written
    profile_dir = Path(summary["run_dir"]) / PROFILE_DIR
    print_table(Path(summary["run_dir"]))
    log.info(f"profile: {profile_dir / BREAKDOWN_FILE} (the table above) and a Chrome trace per rank, "
             f"{profile_dir}/rank<r>.json: open in https://ui.perfetto.dev or chrome://tracing")
    return 0
