"""raydl bench gpu_vs_nanogpt: raydl's worker vs its plain loop vs nanoGPT's train.py, all compiled, one GPU.

Three sides train GPT-2 124M's shape (12 x 768, vocabulary 50304) on 16 x 1024 tokens per step in bf16, on the
same bytes of text, alternating for --repeats rounds: `python -m raydl.worker` (train.compile=true), raydl's
plain loop with its blocks compiled the same way (raydl.bench.overhead.plain_loop), and nanoGPT's `train.py
--compile=True --bias=True` (shared/GPU_NOTES.md's command). Each side's tokens/s counts the steps after the
first fifth over their wall-clock time; its first step's seconds are the compilation's cost. Then one profiled
worker run (telemetry.profile_steps) says where the worker's step goes and what keeps the GPU idle between
kernels. Prints the ratios of the medians; writes JSON (and the profile's breakdown) under --out's folder.

nanoGPT is not part of raydl: its train.py, model.py and configurator.py (karpathy/nanoGPT, commit 3adf61e) sit
in a folder outside the project that --nanogpt names. On the device machine (no network, no Ray), from the repo
root, with that folder copied into an ignored `.nanogpt/` (`echo /.nanogpt/ >> .git/info/exclude`; the files:
`for f in train.py model.py configurator.py; do git -C NANOGPT_MIRROR show 3adf61e:$f > .nanogpt/$f; done`).
Its parts ran on a CPU (--device cpu --tiny --compile false, 6 steps, 2026-11-27); on a GPU, not yet run, it
should take about 6 minutes (3 rounds of 80 steps, the first compilations cold, then the profiled run); --no-profile shortens it:

    PYTHONUNBUFFERED=1 python3 -m raydl.bench.gpu_vs_nanogpt --nanogpt .nanogpt --out $OUT/gpu-vs-nanogpt.json
    # device tool: run(command=<that>, carry=[".nanogpt"], timeout_s=560)
    python -m raydl.bench.gpu_vs_nanogpt --nanogpt DIR --device cpu --tiny --repeats 1   # its parts on CPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from raydl.bench import harness
from raydl.bench.gpu import raydl_worker
from raydl.bench.overhead import plain_loop
from raydl.overrides import load_config

NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
ITER_LINE = re.compile(r"^iter (\d+): loss [\d.naif]+, time ([\d.]+)ms")
# --tiny: the parts on a CPU in seconds (gpt tiny: 4 x 128; nanoGPT the same shape, fp32, eager).
TINY = {"seq": 64, "batch": 4, "size": "tiny", "layers": 4, "width": 128, "heads": 4}
GPT2 = {"seq": 1024, "batch": 16, "size": "gpt2", "layers": 12, "width": 768, "heads": 12}


def corpus(path: Path, megabytes: float) -> Path:
    """A text of `megabytes` from this Python's own library sources (every machine has them, offline)."""
    budget, parts = int(megabytes * 2**20), []
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        parts.append(source.read_bytes())
        budget -= len(parts[-1])
        if budget <= 0:
            break
    path.write_bytes(b"".join(parts)[:int(megabytes * 2**20)])
    return path


def prepare_data(text: Path, work: Path, seq: int) -> tuple[Path, Path]:
    """(raydl dataset, nanoGPT data folder) of the same bytes: raydl packs byte tokens in rows of `seq`;
    nanoGPT reads them as uint16 from train.bin (90%) and val.bin (10%), as GPU_NOTES' measurement did."""
    from raydl.data.prepare import prepare

    dataset = work / "dataset"
    prepare("text", str(text), str(dataset), seq_len=seq, tokenizer="bytes", progress=False)
    tokens = np.frombuffer(text.read_bytes(), dtype=np.uint8).astype(np.uint16)
    cut = int(0.9 * len(tokens))
    bins = work / "nanogpt_data" / "raydlbench"
    bins.mkdir(parents=True, exist_ok=True)
    tokens[:cut].tofile(bins / "train.bin")
    tokens[cut:].tofile(bins / "val.bin")
    return dataset, bins


def worker_sets(args, shape: dict[str, Any], dataset: Path) -> list[str]:
    return ["model.name=gpt", f"model.size={shape['size']}", "model.options.vocab=50304", f"data.path={dataset}",
            f"train.global_batch_size={shape['batch']}", f"train.micro_batch_size={shape['batch']}",
            f"train.max_steps={args.steps}", f"train.precision={args.precision}", f"train.compile={args.compile}",
            "telemetry.progress=false", "train.eval_batches=1", *args.overrides]


def nanogpt_run(args, shape: dict[str, Any], work: Path, bins: Path) -> dict[str, Any]:
    """nanoGPT's train.py in a copy of its folder (its data under data/raydlbench): tokens/s of the iterations
    after the first fifth over the sum of their printed times (wall time since the previous one)."""
    run = Path(tempfile.mkdtemp(dir=work, prefix="nanogpt-"))
    for name in NANOGPT_FILES:
        shutil.copy(Path(args.nanogpt) / name, run / name)
    (run / "data").mkdir()
    (run / "data" / "raydlbench").symlink_to(bins.resolve())
    cpu = args.device == "cpu"
    cmd = [sys.executable, "train.py", "--dataset=raydlbench", f"--batch_size={shape['batch']}",
           f"--block_size={shape['seq']}", "--gradient_accumulation_steps=1", f"--max_iters={args.steps}",
           f"--lr_decay_iters={args.steps}", f"--warmup_iters={min(10, args.steps // 2)}", "--eval_interval=100000",
           "--eval_iters=1",
           "--log_interval=1", f"--compile={not cpu and args.compile == 'true'}",
           f"--dtype={'float32' if cpu else 'bfloat16'}", "--bias=True", "--dropout=0.0",
           "--always_save_checkpoint=False", "--out_dir=ngout", f"--device={args.device}",
           f"--n_layer={shape['layers']}", f"--n_embd={shape['width']}", f"--n_head={shape['heads']}"]
    done = subprocess.run(cmd, cwd=run, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"nanoGPT's train.py failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    times = iteration_times(done.stdout)
    shutil.rmtree(run, ignore_errors=True)
    return {"tokens_per_s": steady_tokens_per_s(times, shape["batch"] * shape["seq"]), "first_step_s": times[0][1]}


def iteration_times(stdout: str) -> list[tuple[int, float]]:
    """(iteration, seconds) of each `iter N: loss L, time T ms, mfu M%` line nanoGPT printed."""
    found = [ITER_LINE.match(line) for line in stdout.splitlines()]
    return [(int(m[1]), float(m[2]) / 1000) for m in found if m]


def steady_tokens_per_s(times: list[tuple[int, float]], tokens_per_step: int) -> float:
    steady = times[max(1, len(times) // 5):]
    return tokens_per_step * len(steady) / sum(s for _, s in steady)


def worker_side(args, shape, dataset: Path, work: Path) -> dict[str, Any]:
    result = raydl_worker(worker_sets(args, shape, dataset), tempfile.mkdtemp(dir=work, prefix="raydl-"))
    return {k: v for k, v in result.items() if not k.startswith("nvml_")}


def plain_side(args, shape, dataset: Path) -> dict[str, Any]:
    import torch

    cfg = load_config(None, worker_sets(args, shape, dataset))
    return plain_loop(cfg, torch.device(args.device), compile=args.compile == "true")


def profile_worker(args, shape, dataset: Path, work: Path, out_dir: Path) -> dict[str, Any]:
    """One worker run with telemetry.profile_steps: its step breakdown, the GPU's idle gaps between kernels
    and the host ops under the longest of them; the trace gzipped beside --out."""
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix="profile-"))
    steps = ["train.max_steps=12", "telemetry.profile_steps=5"]
    raydl_worker([*worker_sets(args, shape, dataset), *steps], str(run_dir))
    breakdown = json.loads((run_dir / "profile" / "breakdown.json").read_text())
    trace = run_dir / "profile" / "rank0.json"
    with trace.open("rb") as src, gzip.open(out_dir / "profile-rank0.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    return {"breakdown": breakdown, "gpu_gaps": gpu_gaps(json.loads(trace.read_text())["traceEvents"])}


def gpu_gaps(events: list[dict[str, Any]], *, top: int = 10, min_gap_us: float = 5.0) -> dict[str, Any]:
    """From a Chrome trace: the device's busy share between its first and last kernel, its idle gaps longer than
    `min_gap_us` (count, total) and the `top` longest, each with the host ops running when it began."""
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                             "gpu_memset"))
    if not kernels:
        return {"kernels": 0}
    gaps, busy, edge = [], 0.0, kernels[0][0]
    for start, end in kernels:
        if start - edge > min_gap_us:
            gaps.append((start - edge, edge))
        busy += max(0.0, end - max(start, edge))
        edge = max(edge, end)
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    longest = sorted(gaps, reverse=True)[:top]
    return {"kernels": len(kernels), "span_us": edge - kernels[0][0], "busy_share": busy / (edge - kernels[0][0]),
            "gaps": len(gaps), "gaps_us": sum(g for g, _ in gaps),
            "longest": [{"us": g, "host_ops": sorted({e["name"] for e in host if e["ts"] <= at <= e["ts"] + e["dur"]})}
                        for g, at in longest]}


def ratios(stats: dict[str, Any]) -> dict[str, float]:
    tokens = {side: s["tokens_per_s"]["median"] for side, s in stats.items()}
    out = {"raydl_over_plain": tokens["raydl"] / tokens["plain"]}
    if "nanogpt" in tokens:
        out |= {"raydl_over_nanogpt": tokens["raydl"] / tokens["nanogpt"],
                "plain_over_nanogpt": tokens["plain"] / tokens["nanogpt"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("gpu_vs_nanogpt", __doc__)
    p.set_defaults(repeats=3, out=str(harness.RESULTS / "gpu-vs-nanogpt.json"))
    p.add_argument("--nanogpt", default="", help="Folder with nanoGPT's train.py, model.py, configurator.py "
                   "(empty: no nanoGPT side).")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--compile", default="true", choices=("true", "false"), help="train.compile of both raydl "
                   "sides, and nanoGPT's --compile (default true).")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="The tiny GPT on 4 x 64 tokens (a CPU check of the parts).")
    p.add_argument("--text-mb", type=float, default=8.0, help="MiB of text (this Python's library sources).")
    p.add_argument("--no-profile", action="store_true", help="Skip the profiled worker run.")
    p.add_argument("--workdir", default="", help="Scratch folder (default: a new temporary one).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = harness.parse_args(p, argv)
    if args.device == "cuda" and not harness.cuda_here("gpu_vs_nanogpt"):
        return 2
    session = harness.Session("gpu_vs_nanogpt", args)
    shape = TINY if args.tiny else GPT2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="raydl-gpu-vs-nanogpt-"))
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dataset, bins = prepare_data(corpus(work / "corpus.txt", args.text_mb), work, shape["seq"])
    print(f"[bench] data ready in {time.perf_counter() - t0:.1f} s", flush=True)
    sides = {"raydl": lambda: worker_side(args, shape, dataset, work), "plain": lambda: plain_side(args, shape, dataset)}
    if args.nanogpt:
        sides["nanogpt"] = lambda: nanogpt_run(args, shape, work, bins)
    runs = harness.alternate(sides, args.repeats)
    stats = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
    for side, s in stats.items():
        print(harness.describe(f"{side} tokens/s", s["tokens_per_s"]), flush=True)
        print(harness.describe(f"{side} first step s", s["first_step_s"]), flush=True)
    found = ratios(stats)
    print("ratios of the medians: " + ", ".join(f"{k} {v:.3f}" for k, v in found.items()), flush=True)
    profile = None if args.no_profile else profile_worker(args, shape, dataset, work, out_dir)
    if profile:
        print(f"[bench] profile: GPU busy {profile['gpu_gaps'].get('busy_share')}, gaps "
              f"{profile['gpu_gaps'].get('gaps_us')} us; breakdown {json.dumps(profile['breakdown']['ranks'][0])[:600]}",
              flush=True)
    session.write(shape=shape, steps=args.steps, precision=args.precision, compile=args.compile,
                  overrides=args.overrides, sides=stats, ratios=found, profile=profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
