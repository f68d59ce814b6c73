"""raydl bench overhead: raydl (Ray Train, 1 worker) vs a plain single-process PyTorch loop.

Same model (tiny GPT), same built-in data, same optimizer and step count. Prints the
steady-state samples/s of each (median over the steps after the first fifth), the ratio
raydl / plain (goal >= 0.97) and raydl's time from `run_training` to its first finished step.
Runs alternate so that background load hits both sides alike; medians over --repeats.

    raydl bench overhead --steps 300 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from raydl.bench.common import machine, write_result
from raydl.data.dataset import open_dataset, resolve_path
from raydl.data.loader import SplitReader
from raydl.models.registry import get_spec
from raydl.overrides import load_config
from raydl.train.optim import build_optimizer, lr_at, set_lr


def steady(values: list[float]) -> float:
    return statistics.median(values[len(values) // 5:])


def plain_loop(cfg) -> float:
    """What a user would write by hand: tensors in memory, a model, AdamW, a for loop."""
    spec = get_spec(cfg.model)
    info = open_dataset(resolve_path(cfg, spec.task))
    reader = SplitReader(info, "train", seed=0, shuffle=False)
    table = reader.rows(reader.order(0), 0, reader.order(0).num_rows)
    inputs = torch.tensor(table.column("input_ids").to_pylist())
    labels = torch.tensor(table.column("labels").to_pylist())
    torch.manual_seed(cfg.train.seed)
    model = spec.build(cfg.model, info.meta)
    optimizer = build_optimizer(model.parameters(), cfg.train)
    gb, rates = cfg.train.global_batch_size, []
    for step in range(cfg.train.max_steps):
        t0 = time.perf_counter()
        set_lr(optimizer, lr_at(step, cfg.train, cfg.train.max_steps))
        i = (step * gb) % (len(inputs) - gb)
        loss = spec.loss(model(inputs[i:i + gb].long()), labels[i:i + gb].long())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss)   # the same sync point raydl's step has
        rates.append(gb / (time.perf_counter() - t0))
    return steady(rates)


def raydl_run(cfg) -> tuple[float, float]:
    from raydl.driver.ray_trainer import run_training

    t0 = time.time()
    summary = run_training(cfg)
    first = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])
    return summary["samples_per_s"], first["time"] - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raydl bench overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/overhead-cpu.json")
    args = p.parse_args(argv)
    runs = Path(tempfile.mkdtemp(prefix="raydl-bench-"))
    sets = [f"train.max_steps={args.steps}", "train.global_batch_size=64", "train.micro_batch_size=64",
            "scaling.min_workers=1", "scaling.max_workers=1", f"run.runs_dir={runs}", "telemetry.progress=false",
            f"checkpoint.every_steps={args.steps}", "telemetry.report_every=50"]
    plain, ray_rates, first_step = [], [], []
    for i in range(args.repeats):
        plain.append(plain_loop(load_config(None, sets)))
        rate, first = raydl_run(load_config(None, sets + [f"run.name=bench{i}"]))
        ray_rates.append(rate)
        first_step.append(first)
        print(f"repeat {i}: plain {plain[-1]:.0f} samples/s, raydl {rate:.0f} samples/s, first step {first:.1f}s")
    result = {"benchmark": "overhead", "machine": machine(), "steps": args.steps, "repeats": args.repeats,
              "plain_samples_per_s": plain, "raydl_samples_per_s": ray_rates, "raydl_time_to_first_step_s": first_step,
              "median_plain": statistics.median(plain), "median_raydl": statistics.median(ray_rates),
              "ratio_raydl_over_plain": statistics.median(ray_rates) / statistics.median(plain),
              "median_time_to_first_step_s": statistics.median(first_step)}
    print(f"plain {result['median_plain']:.0f} samples/s | raydl {result['median_raydl']:.0f} samples/s | "
          f"ratio {result['ratio_raydl_over_plain']:.3f} (goal >= 0.97) | time to first step "
          f"{result['median_time_to_first_step_s']:.1f}s")
    write_result(args.out, result)
    return 0
