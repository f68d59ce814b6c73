"""raydl bench lora_memory: peak memory per worker with and without LoRA (train.lora), measured and predicted.

    raydl bench lora_memory --repeats 2                                 # gpt-100m, dp=1, adamw
    raydl bench lora_memory --repeats 1 --model gpt-302m --layout dp2-fsdp --rank 16

Each run is a real `raydl train` (a subprocess, 2 steps, AdamW, micro-batch 1) whose workers write their RSS
high-water marks (debug.memory_dir, as `raydl bench memory` runs them). Sides, alternated: `full` trains every
weight, `lora` adapters of rank --rank on every Linear layer but the head, the base frozen. A LoRA worker still holds
the whole base model, but gradients and AdamW's two moments only for the adapters: the full side's peak carries
about 3 x the fp32 model more (grads + 2 moments). Printed: each side's whole-run peak per rank, the prediction
(raydl.parallel.memory, from the same config, the adapters counted as the workers build them), and lora/full.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from raydl.bench import harness
from raydl.bench.memory import COMMON, LAYOUTS, MODELS, predicted, train_once

SIDES = ("full", "lora")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("lora_memory", __doc__)
    p.set_defaults(repeats=2)
    p.add_argument("--model", default="gpt-100m", choices=[m for m in MODELS if m.startswith("gpt")])
    p.add_argument("--layout", default="dp1", choices=list(LAYOUTS))
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (train.lora.rank).")
    args = harness.parse_args(p, argv)
    session = harness.Session("lora_memory", args)
    work = Path(tempfile.mkdtemp(prefix="raydl-bench-lora-", dir="/tmp"))
    data = work / "data"
    base = [*COMMON, "train.optimizer=adamw", f"data.cache_dir={data}", *LAYOUTS[args.layout], *MODELS[args.model]]
    overrides = {"full": base, "lora": [*base, f"train.lora.rank={args.rank}"]}
    try:
        prediction = {side: predicted(sets, data) for side, sets in overrides.items()}
        need = int(prediction["full"]["total_bytes"] * 1.5)
        runs = harness.alternate({side: (lambda sets=sets: train_once(work, sets, need))
                                  for side, sets in overrides.items()}, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stats = {side: harness.summarize(r) for side, r in runs.items()}
    ranks = sorted({k.split(":")[0] for k in stats["full"] if k.startswith("rank")})
    rows = []
    for r in ranks:
        pp_rank = int(stats["full"][f"{r}:pp_rank"]["median"])
        measured = {side: stats[side][f"{r}:end_mib"]["median"] for side in SIDES}
        want = {side: prediction[side]["peak_mib_by_pp_rank"][pp_rank] for side in SIDES}
        rows.append({"rank": r, "measured_peak_mib": measured, "predicted_peak_mib": want,
                     "measured_lora_over_full": round(measured["lora"] / measured["full"], 3),
                     "measured_saved_mib": round(measured["full"] - measured["lora"]),
                     "predicted_saved_mib": round(want["full"] - want["lora"])})
        print(f"{args.model} {args.layout} {r}: whole-run peak full {measured['full']:,.0f} MiB, lora "
              f"{measured['lora']:,.0f} MiB (lora/full {rows[-1]['measured_lora_over_full']:.2f}; saved "
              f"{rows[-1]['measured_saved_mib']:,} MiB, predicted saved {rows[-1]['predicted_saved_mib']:,} MiB)")
    for side in SIDES:
        print(f"  predicted {side}: {prediction[side]['breakdown']}")
    session.write(model=args.model, layout=args.layout, lora_rank=args.rank, prediction=prediction, ranks=rows,
                  runs=stats, note=NOTE)
    return 0


NOTE = ("Peaks are RSS high-water marks (MiB) of each Ray Train worker over the whole run (its process, torch and "
        "Ray included, alike on both sides); predicted peaks are raydl.parallel.memory's, without that runtime, so "
        "the saved MiB are the comparable figures. 2 steps, AdamW, micro-batch 1, on a shared 2-core machine.")
