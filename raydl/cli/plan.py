"""raydl plan: profile the configured model on this device and print the planner's candidate layouts.

    raydl plan --workers 4
    raydl plan --workers 8 --memory-gb 16 --set model.size=small
    raydl plan --workers 2 --set parallel.pp_degree=2 --set parallel.schedule=zbv   # check one layout
"""

from __future__ import annotations

from raydl.cli.common import add_config_args, config_from_args, parser_kwargs


def register(sub) -> None:
    p = sub.add_parser("plan", **parser_kwargs("Profile the model here and show the dp x pp layouts the planner considers."))
    add_config_args(p)
    p.add_argument("--workers", type=int, required=True, help="World size to plan for.")
    p.add_argument("--memory-gb", type=float, help="Memory per worker in GiB (default: this GPU's, or RAM / workers).")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from raydl.models.choice import choose_model
    from raydl.parallel.mesh import min_micro_batch, plan_layouts
    from raydl.parallel.profile import device_memory_bytes, profile_model
    from raydl.parallel.search import format_table

    if not any(o.startswith("parallel.pp_degree=") for o in args.overrides):
        args.overrides = ["parallel.pp_degree=auto", *args.overrides]   # list every pp unless one is asked for
    cfg = config_from_args(args)
    chosen = choose_model(cfg.model)
    info = chosen.open_dataset(cfg)
    torch.manual_seed(cfg.train.seed)
    model = chosen.build(info.meta, pp_degree=cfg.parallel.pp_degree)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    memory = int(args.memory_gb * 2**30) if args.memory_gb else device_memory_bytes(device, args.workers)
    profile = profile_model(model, chosen.spec, info.meta, micro_batch=cfg.train.micro_batch_size,
                            precision=cfg.train.precision, device=device)
    chosen, candidates = plan_layouts(profile, cfg, world_size=args.workers, memory_bytes=memory)
    print(f"{len(profile.blocks)} blocks profiled on {device.type} at micro-batch {profile.micro_batch}; "
          f"{memory / 2**30:.1f} GiB per worker; micro-batches below {min_micro_batch(cfg)} not chosen")
    print(format_table(candidates, chosen))
    return 0
