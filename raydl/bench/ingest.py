"""raydl bench ingest: parquet token rows -> torch tensors, plain pyarrow vs raydl's loader paths.

    raydl bench ingest [--rows 51200] [--seq-len 512] [--repeats 6] [--runs 3] [--variants ...]
                       [--summary RUN/summary.json ...]

Generates (once) a raydl dataset of random token rows (input_ids + labels, int32; 51,200 x
512 = 210 MB raw) under --dir (default /tmp), then times `--repeats` consecutive epochs of:
  pyarrow        ParquetFile.iter_batches(batch) -> torch.from_numpy, one process, file order
  arrow          one raydl StepLoader, data.backend=arrow (shuffled windows, prefetch thread), 1 rank
  ray            one raydl StepLoader, data.backend=ray (Ray Data read tasks, one execution for several epochs), 1 rank
Each variant runs in its own process; the first epoch is cold (for ray it includes starting
Ray's worker processes), the median of the rest is reported. Prints rows/s and the ratio to
pyarrow for each of `--runs` runs and the median ratio, and the data-wait share of training
runs' summary.json; writes --out (JSON).
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

VARIANTS = ("pyarrow", "arrow", "ray")   # pyarrow first: the others are divided by it


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


def epochs_loader(path: Path, batch: int, backend: str, epochs: int) -> tuple[int, list[float]]:
    """One loader over `epochs` epochs, as training uses it: (rows per epoch, seconds per epoch)."""
    from raydl.data.dataset import open_dataset
    from raydl.data.loader import StepLoader
    from raydl.data.order import DataPosition

    loader = StepLoader(open_dataset(str(path)), global_batch=batch, dp_rank=0, dp_size=1, seed=0, shuffle=True,
                        position=DataPosition(0, 0), prefetch=2, backend=backend)
    steps, times = iter(loader), []
    for _ in range(epochs):
        t0, rows = time.perf_counter(), 0
        for _ in range(loader.steps_per_epoch):
            rows += len(next(steps).tensors["input_ids"])
        times.append(time.perf_counter() - t0)
    return rows, times


def run_variant(variant: str, path: Path, batch: int, repeats: int) -> dict:
    """In this process: `repeats` timed epochs of one variant."""
    import torch

    torch.set_num_threads(1)
    if variant.startswith("ray"):
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    if variant == "pyarrow":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            rows = epoch_pyarrow(path, batch)
            times.append(time.perf_counter() - t0)
    else:
        rows, times = epochs_loader(path, batch, variant, repeats)
    warm = times[1:] or times
    return {"rows": rows, "epoch_s": times, "cold_s": times[0], "warm_median_s": statistics.median(warm),
            "rows_per_s": rows / statistics.median(warm)}


def run_all(args) -> dict:
    """Every variant once, each in its own process; ratios to this run's pyarrow."""
    out = {"variants": {}}
    for variant in ["pyarrow", *(v for v in args.variants if v != "pyarrow")]:
        cmd = [sys.executable, "-m", "raydl.bench.ingest", "--variant", variant, "--rows", str(args.rows),
               "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--repeats", str(args.repeats),
               "--dir", args.dir]
        p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"[bench] {variant} failed:\n{p.stderr[-2000:]}")
        r = out["variants"][variant] = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"[bench] {variant:8s} {r['rows_per_s']:>10,.0f} rows/s  warm epoch {r['warm_median_s']:.2f}s "
              f"(cold {r['cold_s']:.2f}s)", flush=True)
    base = out["variants"]["pyarrow"]["rows_per_s"]
    out["ratio_to_pyarrow"] = {k: v["rows_per_s"] / base for k, v in out["variants"].items()}
    print("[bench] ratio b/a: " + ", ".join(f"{k} {v:.2f}" for k, v in out["ratio_to_pyarrow"].items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raydl bench ingest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=51200)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=256, help="Rows per batch (the loader's global batch).")
    p.add_argument("--repeats", type=int, default=6, help="Epochs per variant and run; the first is cold.")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--dir", default="/tmp/raydl-bench", help="Where the benchmark dataset is generated.")
    p.add_argument("--runs", type=int, default=3, help="Runs of every variant; ratios are the median over runs.")
    p.add_argument("--summary", nargs="*", help="Training runs' summary.json files, for their data-wait share.")
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
              "runs": [run_all(args) for _ in range(args.runs)]}
    result["median_ratio_to_pyarrow"] = {
        k: statistics.median(r["ratio_to_pyarrow"][k] for r in result["runs"]) for k in result["runs"][0]["variants"]}
    print(f"[bench] median ratio b/a over {args.runs} runs: "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["median_ratio_to_pyarrow"].items()))
    result["training_data_wait_frac"] = {}
    for summary_path in args.summary or []:
        summary = json.loads(Path(summary_path).read_text())
        result["training_data_wait_frac"][summary_path] = summary["data_wait_frac"]
        print(f"[bench] data-wait share of step time ({summary_path}): {100 * summary['data_wait_frac']:.3f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
