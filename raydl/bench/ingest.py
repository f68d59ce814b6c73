"""raydl bench ingest: parquet token rows -> torch tensors, plain pyarrow vs raydl's loader paths.

    raydl bench ingest [--rows 51200] [--seq-len 512] [--repeats 3] [--variants ...] [--summary RUN/summary.json]

Generates (once) a raydl dataset of random token rows (input_ids + labels, int32; 51,200 x
512 = 210 MB raw) under --dir (default /tmp), then times `--repeats` consecutive epochs of:
  pyarrow        ParquetFile.iter_batches(batch) -> torch.from_numpy, one process, file order
  arrow          one raydl StepLoader, data.backend=arrow (shuffled windows, prefetch thread), 1 rank
  ray            one raydl StepLoader, data.backend=ray (Ray Data read tasks, one execution per epoch), 1 rank
Each variant runs in its own process; the first epoch is cold (for ray it includes starting
Ray's worker processes), the median of the rest is reported. Prints rows/s and the ratio to pyarrow,
and the data-wait share of a training run's summary.json; writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from raydl.bench.common import machine, write_result

import numpy as np
import pyarrow as pa

VARIANTS = ("pyarrow", "arrow", "ray")


def make_dataset(root: Path, rows: int, seq_len: int) -> Path:
    from raydl.data.dataset import write_manifest, write_split

    target = root / f"ingest-{rows}x{seq_len}"
    if (target / "manifest.json").exists():
        return target
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)

    def tables(start: int, stop: int):
        for lo in range(start, stop, 3200):
            n = min(3200, stop - lo)
            x = np.random.default_rng(lo).integers(0, 50257, size=(n, seq_len + 1), dtype=np.int32)
            yield pa.table({"id": pa.array(np.arange(lo, lo + n)),
                            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(x[:, :-1].ravel()), seq_len),
                            "labels": pa.FixedSizeListArray.from_arrays(pa.array(x[:, 1:].ravel()), seq_len)})

    splits = {"train": write_split(tmp, "train", tables(0, rows), shard_rows=3200),
              "eval": write_split(tmp, "eval", tables(rows, rows + 256), shard_rows=3200)}
    write_manifest(tmp, {"task": "tokens", "vocab_size": 50257, "seq_len": seq_len}, splits)
    tmp.rename(target)
    return target


def epoch_pyarrow(path: Path, batch: int) -> int:
    import pyarrow.parquet as pq
    import torch

    rows = 0
    for f in sorted(path.glob("train-*.parquet")):
        for b in pq.ParquetFile(f).iter_batches(batch_size=batch, columns=["input_ids", "labels"]):
            t = {n: torch.from_numpy(b.column(n).flatten().to_numpy().reshape(len(b), -1))
                 for n in ("input_ids", "labels")}
            rows += len(t["input_ids"])
    return rows


def epochs_loader(path: Path, batch: int, backend: str, epochs: int) -> tuple[int, list[float], list[float]]:
    """One loader over `epochs` epochs, as training uses it: rows per epoch, seconds per epoch, and
    seconds each epoch waited for its first step (an execution's start-up, for the ray backend)."""
    from raydl.data.dataset import open_dataset
    from raydl.data.loader import StepLoader
    from raydl.data.order import DataPosition

    loader = StepLoader(open_dataset(str(path)), global_batch=batch, dp_rank=0, dp_size=1, seed=0, shuffle=True,
                        position=DataPosition(0, 0), prefetch=2, backend=backend)
    steps, times, firsts = iter(loader), [], []
    for _ in range(epochs):
        t0 = time.perf_counter()
        rows = len(next(steps).tensors["input_ids"])
        firsts.append(time.perf_counter() - t0)
        for _ in range(loader.steps_per_epoch - 1):
            rows += len(next(steps).tensors["input_ids"])
        times.append(time.perf_counter() - t0)
    return rows, times, firsts


def run_variant(variant: str, path: Path, batch: int, repeats: int) -> dict:
    """In this process: `repeats` timed epochs of one variant."""
    import torch

    torch.set_num_threads(1)
    if variant.startswith("ray"):
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    firsts: list[float] = []
    if variant == "pyarrow":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            rows = epoch_pyarrow(path, batch)
            times.append(time.perf_counter() - t0)
    else:
        rows, times, firsts = epochs_loader(path, batch, variant, repeats)
    warm = times[1:] or times
    out = {"rows": rows, "epoch_s": times, "cold_s": times[0], "warm_median_s": statistics.median(warm),
           "rows_per_s": rows / statistics.median(warm)}
    if firsts:    # past each epoch's first step: the streaming rate without the epoch's start-up
        out["first_step_s"] = firsts
        out["steady_rows_per_s"] = statistics.median((rows - batch) / (t - f) for t, f in zip(times[1:], firsts[1:]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raydl bench ingest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=51200)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=256, help="Rows per batch (the loader's global batch).")
    p.add_argument("--repeats", type=int, default=4, help="Epochs per variant; the first is cold.")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--dir", default="/tmp/raydl-bench", help="Where the benchmark dataset is generated.")
    p.add_argument("--summary", help="A training run's summary.json, for its data-wait share.")
    p.add_argument("--out", default="benchmarks/results/ingest-cpu.json")
    p.add_argument("--variant", help=argparse.SUPPRESS)   # internal: run one variant in this process
    args = p.parse_args(argv)
    path = make_dataset(Path(args.dir), args.rows, args.seq_len)
    if args.variant:
        print(json.dumps(run_variant(args.variant, path, args.batch, args.repeats)))
        return 0
    size = sum(f.stat().st_size for f in path.glob("train-*.parquet"))
    result = {"machine": machine(), "dataset": {"path": str(path), "rows": args.rows, "seq_len": args.seq_len,
                                                "raw_mb": args.rows * args.seq_len * 4 * 2 / 1e6,
                                                "disk_mb": size / 1e6, "batch": args.batch},
              "variants": {}}
    for variant in args.variants:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "raydl.bench.ingest", "--variant", variant, "--rows", str(args.rows),
               "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--repeats", str(args.repeats),
               "--dir", args.dir]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"[bench] {variant} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        result["variants"][variant] = r
        steady = f", {r['steady_rows_per_s']:,.0f} rows/s past each epoch's first step" if "first_step_s" in r else ""
        print(f"[bench] {variant:8s} {r['rows_per_s']:>10,.0f} rows/s  warm epoch {r['warm_median_s']:.2f}s "
              f"(cold {r['cold_s']:.2f}s){steady}", flush=True)
    base = result["variants"].get("pyarrow", {}).get("rows_per_s")
    if base:
        result["ratio_to_pyarrow"] = {k: v["rows_per_s"] / base for k, v in result["variants"].items()}
        result["steady_ratio_to_pyarrow"] = {k: v["steady_rows_per_s"] / base for k, v in result["variants"].items()
                                             if "steady_rows_per_s" in v}
        print("[bench] ratio b/a: " + ", ".join(f"{k} {v:.2f}" for k, v in result["ratio_to_pyarrow"].items()))
        print("[bench] ratio b/a past each epoch's first step: "
              + ", ".join(f"{k} {v:.2f}" for k, v in result["steady_ratio_to_pyarrow"].items()))
    if args.summary:
        summary = json.loads(Path(args.summary).read_text())
        result["training_data_wait_frac"] = {"summary": args.summary, "data_wait_frac": summary["data_wait_frac"]}
        print(f"[bench] data-wait share of step time ({args.summary}): {100 * summary['data_wait_frac']:.2f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
