"""raydl sweep: Ray Tune sweep over any config keys (default: batch size x precision), report + best.yaml.

    raydl sweep                                   # batch sizes x {fp32, bf16 (+fp16 on GPU)}, tiny GPT, ~minutes
    raydl sweep --config jobs/configs/sweep-default.yaml --set train.max_steps=50
    raydl sweep --config sweep.yaml --address auto
    raydl sweep --resume runs/sweep-20260101-120000
    raydl -v sweep                                # also Tune's own progress tables

The report has each trial's start (seconds from its start to its first finished step); a 1-worker trial
trains in its Tune trial's own process, which the next trial reuses.
"""

from __future__ import annotations

SWEEP_HELP = """sweep file (YAML):
  base: {section: {key: value}}   training config every trial starts from (or base_config: FILE)
  space: {section.key: VALUES}    [a, b] grid | choice([a, b]) | uniform(a, b) | loguniform(a, b) | randint(a, b)
  objective: time_to_target       eval_loss (after sample_budget) | samples_per_s | time_to_target | cost_to_target (need target_loss)
  target_loss: 1.8                target_metric: train_loss (mean of 10 steps) | eval_loss (needs train.eval_every)
  lr_scaling: none                none | linear | sqrt: scale train.lr with global batch / base global batch
  sample_budget: 0                samples per trial (max_steps = budget / batch); 0 = base max_steps * base batch
  micro_batch: per_worker         per_worker: micro-batch = global batch / workers (no accumulation) | config
  num_samples: 1                  repeats of the grid (random dimensions drawn anew)
  max_concurrent_trials: 0        0 = as many as the cluster fits (a 1-worker trial: its worker's CPUs;
                                  a larger one: 1 CPU for its Train driver + its workers')
  asha: false                     true or {grace_samples: N, reduction_factor: 2}: stop bad trials early
"""


def register(sub) -> None:
    import argparse

    p = sub.add_parser("sweep", help="Sweep batch size, precision or any config key with Ray Tune.",
                       description=__doc__, epilog=SWEEP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="Sweep YAML file (see below); default: the built-in batch x precision sweep.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Override a field of the base training config; repeatable.")
    p.add_argument("--address", help="Ray cluster to use (e.g. auto); default: RAY_ADDRESS when it names a cluster (as ray.init reads it), else a private local Ray.")
    p.add_argument("--resume", metavar="SWEEP_DIR", help="Continue an interrupted sweep from its directory.")
    p.set_defaults(func=run)


def run(args) -> int:
    from raydl import api

    summary = api.sweep(args.config, overrides=args.overrides, address=args.address, resume=args.resume)
    interrupted = summary["not_started"] or any(r["status"] == "unfinished" for r in summary["trials"])
    return 130 if interrupted else 0
