"""Train a model defined right here, from Python: raydl.train with an inline raydl.ModelSpec.

    python examples/train_from_python.py --steps 100 --workers 2

The spec below lives in this script (or a notebook cell): raydl.train(model=spec) sends it to the
Ray workers pickled, so nothing needs to be importable there. The model is a plain nn.Sequential
without `blocks`: it trains with every data-parallel wrapper (pp=1); a pipeline would need
`blocks` (see examples/mlp_classifier.py). Without an options dataclass, model.options reaches
`build` as the plain dict it is. Prints the first and last training loss and the run directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import raydl


def build(options: dict, meta: dict) -> nn.Module:
    channels, height, width = meta["image_shape"]
    hidden = options.get("hidden", 64)
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, hidden), nn.ReLU(),
                         nn.Linear(hidden, meta["num_classes"]))


spec = raydl.ModelSpec(
    name="inline_mlp", build=build, loss=F.cross_entropy, task="images", columns=("image", "label"),
    inputs_targets=lambda batch: (batch["image"].float() / 255.0, batch["label"].long()),
    example_inputs=lambda meta, micro_batch: torch.rand(micro_batch, *meta["image_shape"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args()
    config = {"model": {"options": {"hidden": 128}},
              "train": {"max_steps": args.steps, "global_batch_size": 64, "micro_batch_size": 32},
              "scaling": {"min_workers": args.workers, "max_workers": args.workers},
              "run": {"runs_dir": args.runs_dir}, "telemetry": {"progress": False}}
    summary = raydl.train(config, overrides=args.overrides, model=spec)
    metrics = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in metrics]
    print(json.dumps({"first_loss": losses[0], "last_loss": losses[-1], "run_dir": summary["run_dir"]}))


if __name__ == "__main__":
    main()
