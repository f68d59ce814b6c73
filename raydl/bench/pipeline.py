"""raydl bench pipeline: bubble, step time and activation memory of every pipeline schedule at p=2.

    raydl bench pipeline                        # simulated compute (default): holds on a loaded machine
    raydl bench pipeline --mode real --repeats 7

Two gloo processes spawned from this one run raydl's own stages (`pipeline_model`: the schedules of
torch.distributed.pipelining, real P2P of real activations) for p=2, m in {1, 2, 4, 8} and every
schedule torch accepts for (p, m). The model is 4 blocks of Linear(dim, dim) + GELU: gpipe and 1f1b
give each rank one stage of 2 blocks, the other schedules 2 stages of 1 block, so every rank does
the same work per micro-batch in every schedule.

Compute (--mode)
  sim   each block's forward (F), input-gradient (B) and weight-gradient (W) pass sleeps --cost-ms:
        F in the forward, B and W in autograd Functions on the activation and the weight path, so the
        zero-bubble schedules' split backward moves them as it moves real work. A sleep needs no free
        core, so a loaded machine barely changes the result; a late wake-up counts as compute (busy).
  real  the blocks' real matmuls; each rank's compute is timed by re-running its stages on the same
        micro-batches without communication right after each step. Noisy on a shared machine.
Per config: --warmup steps, then --repeats timed steps, the configs alternating step by step; medians
are reported, with min, max and spread beside them in the result file.
  step     barrier, schedule.step(); the longest of the two ranks
  busy     time in the sleeps (sim) or in the local re-run (real) on the busier rank
  bubble   1 - busy / step
  memory   one more step under autograd saved_tensors_hooks: peak live bytes of the tensors saved for
           backward on each rank (deduplicated by data pointer, parameters excluded), and that peak in
           micro-batches (divided by what one micro-batch through the rank's stages saves)
Beside them: (p-1)/(m+p-1) for gpipe/1f1b, and the planner's bubble, activation memory and step time
(`planner.evaluate` on a ModelProfile of the 4 blocks: F = 1 pass, backward = 2 passes, the measured
saved bytes per block and the measured P2P latency). The step time is predicted twice: from the
nominal pass cost (--cost-ms) and from the measured one (busier rank's compute / passes, which
includes oversleep; in real mode the only one).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from raydl.bench import harness
from raydl.bench.pipeline_model import PP
from raydl.bench.pipeline_ranks import run_ranks
from raydl.bench.pipeline_report import accepted_configs, check_goals, error_summary, report, summarize
from raydl.errors import ConfigError
from raydl.parallel import schedules


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("pipeline", __doc__)
    p.add_argument("--mode", choices=("sim", "real"), default="sim", help="Simulated (sleep) or real compute.")
    p.add_argument("--warmup", type=int, default=2, help="Untimed steps per config before the timed ones.")
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=list(schedules.NAMES), choices=schedules.NAMES)
    p.add_argument("--cost-ms", type=float, default=20.0,
                   help="sim: sleep per pass (F, B, W) per block; a rank does 6 per micro-batch.")
    p.add_argument("--dim", type=int, default=None, help="Block width (default 64 sim, 1024 real).")
    p.add_argument("--batch", type=int, default=None, help="Samples per step (default 64 sim, 256 real).")
    args = harness.parse_args(p, argv)
    settings = _settings(args)
    session = harness.Session("pipeline", args)
    raw = run_ranks(settings)
    rows = summarize(raw, settings)
    goals = check_goals(rows)
    report(rows, goals, raw["p2p_latency_s"])
    session.write(method=__doc__, settings=settings, p2p_latency_s=raw["p2p_latency_s"], rows=rows, goals=goals,
                  planner_step_error_pct=error_summary(rows))
    return 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.warmup < 0:
        raise ConfigError("--warmup", f"is {args.warmup}", "use --warmup >= 0")
    sim = args.mode == "sim"
    batch = args.batch or (64 if sim else 256)
    bad = [m for m in args.microbatches if m < 1 or batch % m]
    if bad:
        raise ConfigError("--microbatches", f"has {bad}, which do not divide --batch={batch}",
                          f"use divisors of {batch} (e.g. 1 2 4 8)")
    if sim and args.cost_ms <= 0:
        raise ConfigError("--cost-ms", f"is {args.cost_ms}", "use a positive sleep per pass, e.g. 20")
    configs, skipped = accepted_configs(args.schedules, args.microbatches, batch=batch)
    if not configs:
        raise ConfigError("--schedules/--microbatches", f"leave no pair torch accepts at pp={PP}: "
                          + "; ".join(skipped.values()), "add micro-batch counts or schedules")
    return {"mode": args.mode, "pp": PP, "repeats": args.repeats, "warmup": args.warmup, "batch": batch,
            "dim": args.dim or (64 if sim else 1024), "cost_s": args.cost_ms / 1e3 if sim else 0.0,
            "configs": configs, "skipped": skipped}


if __name__ == "__main__":
    sys.exit(main())
