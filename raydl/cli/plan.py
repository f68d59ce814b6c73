"""raydl plan: profile the configured model on this device and print the planner's candidate layouts, or, with
--cluster, the predicted step time, wall time and $ of every node type x node count x layout of a cluster config.

    raydl plan --workers 4
    raydl plan --workers 8 --memory-gb 16 --set model.size=small
    raydl plan --workers 2 --set parallel.pp_degree=2 --set parallel.schedule=zbv   # check one layout
    raydl plan --cluster cluster/aws-gpu.yaml --steps 20000 --deadline 12 --budget 100 --set train.precision=bf16
"""

from __future__ import annotations

from pathlib import Path

from raydl.cli import output
from raydl.cli.common import add_config_args, config_from_args, parser_kwargs
from raydl.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("plan", **parser_kwargs("Profile the model here and show the dp x pp layouts the planner "
                                               "considers, or (--cluster) what each node type and count would cost."))
    add_config_args(p)
    p.add_argument("--workers", type=int, help="World size to plan for (without --cluster).")
    p.add_argument("--memory-gb", type=float, help="Memory per worker in GiB (default: this GPU's, or RAM / workers).")
    p.add_argument("--cluster", help="A Ray cluster-launcher config (cluster/aws-gpu.yaml): predict step time, wall "
                   "time and $ for each node type x node count x layout it allows (the model and its assumptions: "
                   "raydl/parallel/cluster_plan.py).")
    p.add_argument("--steps", type=int, help="Optimizer steps of the run (--cluster; default train.max_steps).")
    p.add_argument("--deadline", type=float, help="Hours the run may take (--cluster): names the cheapest plan within.")
    p.add_argument("--budget", type=float, help="Dollars the run may cost (--cluster): names the fastest plan within.")
    p.set_defaults(func=run)


def run(args) -> int:
    from raydl.parallel.profile_here import profile_here

    _check_args(args)
    if not any(o.startswith("parallel.pp_degree=") for o in args.overrides):
        args.overrides = ["parallel.pp_degree=auto", *args.overrides]   # list every pp unless one is asked for
    cfg = config_from_args(args)
    profiled = profile_here(cfg)
    return _plan_cluster(args, cfg, profiled) if args.cluster else _plan_layouts(args, cfg, profiled)


def _check_args(args) -> None:
    if (args.workers is None) == (args.cluster is None):
        raise ConfigError("--workers", "and --cluster: give exactly one", "plan a layout for a world size with "
                          "--workers N, or node types, counts and $ with --cluster FILE")
    if not args.cluster:
        for flag in ("steps", "deadline", "budget"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag}", "only applies with --cluster", f"add --cluster FILE or drop --{flag}")
    for flag in ("workers", "steps", "deadline", "budget"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ConfigError(f"--{flag}", f"is {value}", f"give a positive --{flag}")


def _plan_layouts(args, cfg, profiled) -> int:
    from raydl.parallel.mesh import min_micro_batch, plan_layouts
    from raydl.parallel.profile import device_memory_bytes
    from raydl.parallel.search import format_table

    profile = profiled.measured.profile
    memory = int(args.memory_gb * 2**30) if args.memory_gb else device_memory_bytes(profiled.device, args.workers)
    best, candidates = plan_layouts(profile, cfg, world_size=args.workers, memory_bytes=memory)
    print(f"{len(profile.blocks)} blocks profiled on {profiled.device.type} at micro-batch {profile.micro_batch}; "
          f"{memory / 2**30:.1f} GiB per worker; micro-batches below {min_micro_batch(cfg)} not chosen",
          file=output.result())
    print(format_table(candidates, best), file=output.result())
    return 0


def _plan_cluster(args, cfg, profiled) -> int:
    import torch

    from raydl.parallel import cluster_plan, cluster_plan_table
    from raydl.parallel.profile import device_memory_bytes
    from raydl.telemetry.cost import PriceTable

    table = PriceTable.load()
    node_types, head_usd = cluster_plan.read_cluster(Path(args.cluster), table, cfg,
                                                     host_memory_bytes=device_memory_bytes(torch.device("cpu"), 1))
    steps = args.steps or cfg.train.max_steps
    deadline_s = args.deadline * 3600 if args.deadline else None
    measured = profiled.measured
    plan = cluster_plan.plan_cluster(measured, cfg, node_types, steps=steps, head_usd_per_hour=head_usd,
                                     deadline_s=deadline_s, budget_usd=args.budget)
    print(f"{len(measured.profile.blocks)} blocks profiled on {measured.device} at micro-batch "
          f"{measured.profile.micro_batch}, {cfg.train.precision}, optimizer step {1e3 * measured.optimizer_s:.1f} ms; "
          f"another GPU is taken to run the model's FLOPs at {cluster_plan.GPU_MFU:.0%} of its dense peak; prices: "
          f"{table.path} (list prices, check them); head ${head_usd:.3f}/h; start-up "
          f"{cluster_plan.START_UP_S / 60:.0f} min; assumptions: raydl/parallel/cluster_plan.py", file=output.result())
    print(cluster_plan_table.format_plan(plan, steps=steps, deadline_s=deadline_s, budget_usd=args.budget),
          file=output.result())
    return 0
