"""raydl bench gpu: raydl's per-worker engine vs a plain PyTorch loop on one GPU, per precision, MFU (no Ray).

Both sides train the same GPT (default the gpt2 preset: GPT-2 124M's body, with nanoGPT's vocabulary of
50304 rows: GPT-2's 50257 padded to a multiple of 64, which keeps the head's matrix products on aligned
kernels) on the same parquet dataset, with AdamW and the same batch. raydl runs as
`python -m raydl.worker` in a process of its own: the engine Ray's workers run, here without Ray, as on a GPU
box that has none. The plain loop is what a user writes by hand, with the whole dataset already on the GPU.
Per precision it prints the steady-state tokens/s of each side (the steady steps' tokens over their elapsed
wall-clock time), the ratio raydl / plain of the medians, the same ratio of the median per-step rates,
raydl's model TFLOP/s and MFU (bf16 dense peak of the datasheet) and the NVML readings raydl recorded.
`--compile`: both sides compile each repeated block (train.compile=true, and the same function on the plain
model); without it both run eager (train.compile=false). The result file is named by the card.

    python -m raydl.bench.gpu --data DATASET --repeats 5             # a GPU box without Ray
    python -m raydl.bench.gpu --data DATASET --repeats 3 --compile --precisions bf16
    raydl data prepare --from text 'corpus/*.txt' --seq-len 1024 --out DATASET    # a dataset for it
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from raydl.bench import harness
from raydl.bench.overhead import plain_loop
from raydl.overrides import load_config
from raydl.telemetry.records import GPU_KEYS

GOAL = 0.97


def raydl_worker(sets: list[str], run_dir: str) -> dict[str, Any]:
    """`python -m raydl.worker` in its own process: its summary and the median NVML readings of its steps."""
    cmd = [sys.executable, "-m", "raydl.worker", "-q", "--run-dir", run_dir]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return worker_result(Path(run_dir))


def worker_result(run_dir: Path) -> dict[str, Any]:
    """A finished run's wall-clock throughput, median step rate, MFU, peak memory (its summary) and median NVML
    readings. metrics.jsonl has a record per step, with the readings as top-level keys."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    readings = {f"nvml_{key}": statistics.median(r[key] for r in records if key in r)
                for key in GPU_KEYS if any(key in r for r in records)}
    first_step_s = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0]).get("step_s")
    return {"tokens_per_s": summary["tokens_per_s"], "samples_per_s": summary["samples_per_s"],
            "step_rate": summary["step_rate"], "first_step_s": first_step_s,
            "compile_s": (summary.get("compile") or {}).get("seconds"),
            "model_tflops_per_s": summary.get("model_tflops_per_s"), "mfu": summary.get("mfu"),
            "peak_memory_mb": summary["peak_memory_mb"], **readings}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("gpu", __doc__)
    p.set_defaults(out="")
    p.add_argument("--data", required=True, help="Token dataset (raydl data prepare --from text ...).")
    p.add_argument("--size", default="gpt2", help="model.size of the gpt model (default gpt2).")
    p.add_argument("--vocab", type=int, default=50304, help="model.options.vocab (default 50304; 0 = the dataset's).")
    p.add_argument("--batch", type=int, default=16, help="Rows per step (global = micro batch; default 16).")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--precisions", default="bf16,fp16,fp32")
    p.add_argument("--compile", action="store_true", help="Both sides compile each repeated block (default: eager).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = harness.parse_args(p, argv)
    if not harness.cuda_here("gpu"):
        return 2
    args.out = args.out or str(harness.RESULTS / result_name(torch.cuda.get_device_name(0), args.compile))
    session = harness.Session("gpu", args)
    runs_dir = Path(tempfile.mkdtemp(prefix="raydl-bench-gpu-"))
    results: dict[str, Any] = {}
    for precision in args.precisions.split(","):
        sets = ["model.name=gpt", f"model.size={args.size}", f"model.options.vocab={args.vocab}", f"data.path={args.data}",
                f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
                f"train.max_steps={args.steps}", f"train.precision={precision}",
                "telemetry.progress=false", "train.eval_batches=1", f"train.compile={str(args.compile).lower()}",
                *args.overrides]
        runs = harness.alternate(
            {"plain": lambda: plain_loop(load_config(None, sets), torch.device("cuda"), compile=args.compile),
             "raydl": lambda: raydl_worker(sets, tempfile.mkdtemp(dir=runs_dir))}, args.repeats)
        stats = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
        ratio = harness.ratio_of_medians([r["tokens_per_s"] for r in runs["raydl"]],
                                         [r["tokens_per_s"] for r in runs["plain"]])
        print(harness.describe(f"{precision} plain", stats["plain"]["tokens_per_s"], " tokens/s"))
        print(harness.describe(f"{precision} raydl", stats["raydl"]["tokens_per_s"], " tokens/s"))
        if "mfu" in stats["raydl"]:
            print(harness.describe(f"{precision} raydl MFU", stats["raydl"]["mfu"]))
        nvml = {key[5:]: value["median"] for key, value in stats["raydl"].items() if key.startswith("nvml_")}
        if nvml:
            print(f"{precision} raydl NVML medians: " + ", ".join(f"{k} {v:.4g}" for k, v in nvml.items()))
        step_ratio = harness.ratio_of_medians([r["step_rate"] for r in runs["raydl"]],
                                              [r["step_rate"] for r in runs["plain"]])
        print(f"{precision}: wall-clock ratio of medians raydl / plain {ratio:.3f} (goal >= {GOAL}); "
              f"of the median step rates {step_ratio:.3f}", flush=True)
        results[precision] = {"sides": stats, "ratio_raydl_over_plain": ratio, "step_rate_ratio": step_ratio}
    session.write(size=args.size, vocab=args.vocab, batch=args.batch, steps=args.steps, overrides=args.overrides,
                  compile=args.compile, precisions=results, goal_ratio=GOAL)
    return 0


def result_name(card: str, compiled: bool) -> str:
    """gpu-<card>[-compile].json: 'NVIDIA H100 80GB HBM3' -> gpu-nvidia-h100-80gb-hbm3-compile.json."""
    slug = "-".join("".join(c if c.isalnum() else " " for c in card.lower()).split())
    return f"gpu-{slug}{'-compile' if compiled else ''}.json"


if __name__ == "__main__":
    sys.exit(main())
