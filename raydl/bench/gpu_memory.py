"""raydl bench gpu_memory: the memory prediction against the peak a GPU measures, one worker (no Ray).

For each model, precision and optimizer placement (the step after backward, or train.optimizer_in_backward) one
`python -m raydl.worker` run of a few AdamW steps reads `torch.cuda.max_memory_allocated` (the summary's peak,
without the CUDA context) beside the prediction raydl refuses layouts by (raydl.parallel.memory, computed here
from the same config for a cuda device). Memory is deterministic on a GPU: one run per cell. Also printed: the
run's tokens/s and MFU (bf16 dense peak of the datasheet).

    python -m raydl.bench.gpu_memory --out benchmarks/results/gpu-memory-h200.json     # a GPU box without Ray
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from raydl.bench import harness
from raydl.bench.memory import MODELS, predicted

COMMON = ["train.optimizer=adamw", "train.micro_batch_size=8", "train.global_batch_size=8", "train.max_steps=4",
          "train.warmup_steps=1", "train.eval_batches=1", "data.builtin_samples=4096", "telemetry.progress=false",
          "checkpoint.every_steps=1000", "scaling.min_workers=1", "scaling.max_workers=1"]
PLACEMENTS = {"after": [], "in-backward": ["train.optimizer_in_backward=true", "train.grad_clip=0"]}
TARGET_ERROR = 0.15


def run_worker(work: Path, sets: list[str]) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    cmd = [sys.executable, "-m", "raydl.worker", "-q", "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)   # the final checkpoint is the model's size, with its optimizer
    return {k: summary.get(k) for k in ("peak_memory_mb", "tokens_per_s", "mfu", "model_tflops_per_s", "final_loss")}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("gpu_memory", __doc__)
    p.set_defaults(out=str(harness.RESULTS / "gpu-memory.json"), repeats=1)
    p.add_argument("--models", nargs="+", default=["gpt-302m", "gpt-1b"], choices=[m for m in MODELS if m.startswith("gpt")])
    p.add_argument("--precisions", default="fp32,bf16")
    args = harness.parse_args(p, argv)
    if not harness.cuda_here("gpu_memory"):
        return 2
    session = harness.Session("gpu_memory", args)
    work = Path(tempfile.mkdtemp(prefix="raydl-bench-gpumem-"))
    rows = []
    try:
        for name in args.models:
            for precision in args.precisions.split(","):
                for placement, extra in PLACEMENTS.items():
                    sets = [*COMMON, f"data.cache_dir={work / 'data'}", *MODELS[name], f"train.precision={precision}",
                            *extra]
                    want = predicted(sets, work / "data", device_type="cuda")
                    got = harness.summarize([run_worker(work, sets) for _ in range(args.repeats)])
                    measured = got["peak_memory_mb"]["median"]
                    row = {"model": name, "precision": precision, "placement": placement,
                           "predicted_mib": round(want["peak_mib_by_pp_rank"][0]), "measured_mib": round(measured),
                           "error": round(measured / want["peak_mib_by_pp_rank"][0] - 1, 3),
                           "model_mib": round(want["model_mib"]), "breakdown": want["breakdown"],
                           **{k: got[k]["median"] for k in ("tokens_per_s", "mfu", "final_loss") if k in got}}
                    print(f"{name} {precision} {placement}: measured {row['measured_mib']:,} MiB vs predicted "
                          f"{row['predicted_mib']:,} ({100 * row['error']:+.1f}%), {row.get('tokens_per_s', 0):,.0f} "
                          f"tokens/s, MFU {row.get('mfu') or 0:.3f}; {want['breakdown']}", flush=True)
                    rows.append(row)
                    session.write(rows=rows, target_error=TARGET_ERROR, gpu=torch.cuda.get_device_name())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"[bench] worst prediction error {worst:.3f} vs {TARGET_ERROR}: {'met' if worst <= TARGET_ERROR else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
