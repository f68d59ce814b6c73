"""raydl bench overhead: raydl (Ray Train, 1 worker) vs a plain single-process PyTorch loop.

Same model (--model: raydl's tiny GPT, or a tiny Hugging Face Llama that the plain loop calls as
transformers' own model and raydl trains as its blocks), same built-in data, same optimizer and
step count and config (its default report interval and checkpoints included). Prints the steady-state samples/s
of each as a stopwatch sees it (the samples of the steps after the first fifth over their elapsed wall time), the
ratio raydl / plain of the medians over --repeats alternating runs (goal >= 0.97), each side's median per-step
rate beside it (step_rate), and raydl's time from `run_training` to its first finished step.

    raydl bench overhead --steps 300 --repeats 5
    raydl bench overhead --model hf-llama-tiny --repeats 5
    raydl bench overhead --set data.path=DATASET --set train.global_batch_size=12 --set train.micro_batch_size=12
                                                # nanoGPT's batch: 12 rows of a 64-token dataset
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from raydl.bench import harness
from raydl.data.pieces import gather
from raydl.data.shards import SplitReader
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.train.optim import build_optimizer, lr_at, set_lr
from raydl.train.precision import autocast, make_scaler

GOAL = 0.97
# --model: its overrides. hf-llama-tiny has gpt-tiny's shape (4 layers, width 128, 4 heads).
MODELS = {"gpt-tiny": ["model.name=gpt", "model.size=tiny"],
          "hf-llama-tiny": ["model.name=hf", "model.options.family=llama", "model.options.layers=4",
                            "model.options.hidden_size=128", "model.options.heads=4"]}


def steady(values: list[float]) -> float:
    return statistics.median(values[len(values) // 5:])


def plain_loop(cfg, device: torch.device = torch.device("cpu"), *, compile: bool = False) -> dict[str, float]:
    """What a user would write by hand: the dataset as tensors on the device, a model, AdamW, autocast
    (+ GradScaler for fp16), a for loop. Also the plain side of `raydl bench gpu`. `compile`: its repeated
    blocks compiled as raydl compiles them (raydl.parallel.compile); transformers' model, which has no blocks,
    compiled whole. `first_step_s`: the first step's seconds (the compilation, when compiled)."""
    chosen = choose_model(cfg.model)
    info = chosen.open_dataset(cfg)
    reader = SplitReader(info, "train", seed=0, shuffle=False)
    rows = reader.rows(reader.order(0), 0, reader.order(0).num_rows)
    inputs, labels = (torch.from_numpy(gather(rows, name)).to(device) for name in ("input_ids", "labels"))
    torch.manual_seed(cfg.train.seed)
    model, forward = plain_model(chosen, info.meta)
    model.to(device)
    if compile:
        compile_plain(model)
    optimizer = build_optimizer(model.parameters(), cfg.train)
    scaler = make_scaler(cfg.train.precision, device)
    gb, rates, ends = cfg.train.global_batch_size, [], []
    start = max(1, cfg.train.max_steps // 5)   # the steady steps, as raydl's summary counts them
    reads = {1, start, cfg.train.max_steps}    # steps whose end is a stopwatch reading, beside the reports'
    for step in range(cfg.train.max_steps):
        t0 = time.perf_counter()
        set_lr(optimizer, lr_at(step, cfg.train, cfg.train.max_steps))
        i = (step * gb) % (len(inputs) - gb)
        with autocast(cfg.train.precision, device):
            loss = chosen.spec.loss(forward(inputs[i:i + gb].long()), labels[i:i + gb].long())
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        scaler.step(optimizer) if scaler else optimizer.step()
        if scaler:
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % cfg.telemetry.report_every == 0 or step + 1 in reads:
            loss.detach().item()   # raydl reads its losses at its reports (a CPU-GPU sync point), as here
        ends.append(time.perf_counter())
        rates.append(gb / (ends[-1] - t0))
    row_tokens = inputs.shape[1]
    wall = gb * (len(ends) - start) / (ends[-1] - ends[start - 1])
    del model, optimizer, inputs, labels
    if device.type == "cuda":
        torch.cuda.empty_cache()   # raydl's side runs next, in another process on the same GPU
    return {"samples_per_s": wall, "tokens_per_s": wall * row_tokens, "step_rate": steady(rates),
            "first_step_s": gb / rates[0]}


def compile_plain(model: torch.nn.Module) -> None:
    from raydl.parallel.compile import apply_compile

    if hasattr(model, "blocks"):
        apply_compile(model)
    else:
        model.compile()


def plain_model(chosen, meta: dict[str, Any]):
    """(model, its forward as its user would call it): raydl's gpt itself, or transformers' model, not raydl's
    blocks of it."""
    if chosen.spec.name == "hf":
        from raydl.models.hf.model import build_causal_lm

        model = build_causal_lm(chosen.options, meta)
        return model, lambda ids: model(ids, use_cache=False).logits
    model = chosen.build(meta)
    return model, model


def raydl_run(cfg) -> dict[str, float]:
    from raydl.driver.ray_trainer import run_training

    t0 = time.time()
    summary = run_training(cfg)
    first = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])
    return {"samples_per_s": summary["samples_per_s"], "step_rate": summary["step_rate"],
            "time_to_first_step_s": first["time"] - t0}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("overhead", __doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", choices=tuple(MODELS), default="gpt-tiny", help="The model both sides train.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Config overrides for both sides, after the benchmark's own (batch size, steps).")
    args = harness.parse_args(p, argv)
    session = harness.Session("overhead", args)
    runs_dir = Path(tempfile.mkdtemp(prefix="raydl-bench-"))
    sets = MODELS[args.model] + [
            f"train.max_steps={args.steps}", "train.global_batch_size=64", "train.micro_batch_size=64",
            "scaling.min_workers=1", "scaling.max_workers=1", "telemetry.progress=false", *args.overrides]

    def raydl_side() -> dict[str, float]:   # each run in a new directory: a new run, never a resume
        return raydl_run(load_config(None, sets + [f"run.dir={tempfile.mkdtemp(dir=runs_dir)}"]))

    runs = harness.alternate({"plain": lambda: plain_loop(load_config(None, sets)), "raydl": raydl_side},
                             args.repeats)
    stats: dict[str, Any] = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
    ratio = harness.ratio_of_medians([r["samples_per_s"] for r in runs["raydl"]],
                                     [r["samples_per_s"] for r in runs["plain"]])
    print(harness.describe("plain", stats["plain"]["samples_per_s"], " samples/s"))
    print(harness.describe("raydl", stats["raydl"]["samples_per_s"], " samples/s"))
    print(harness.describe("raydl time to first step", stats["raydl"]["time_to_first_step_s"], " s"))
    print(f"ratio of medians raydl / plain {ratio:.3f} (goal >= {GOAL})")
    session.write(steps=args.steps, overrides=args.overrides, sides=stats, ratio_raydl_over_plain=ratio, goal_ratio=GOAL)
    return 0
