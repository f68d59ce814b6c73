"""raydl bench ingest: parquet token rows -> torch tensors, plain pyarrow vs raydl's loader paths.

    raydl bench ingest [--rows 51200] [--seq-len 512] [--epochs 6] [--repeats 5] [--variants ...]
                       [--dp 2,4] [--summary RUN/summary.json ...] [--remote s3://BUCKET/PATH]

Generates (once) a raydl dataset of random token rows (input_ids + labels, int32; 51,200 x
512 = 210 MB raw) under --dir (default /tmp), then times `--epochs` consecutive epochs of:
  pyarrow        ParquetFile.iter_batches(batch) -> torch.from_numpy, one process, file order
  arrow          one raydl StepLoader, data.backend=arrow (shuffled lanes of row groups, prefetch thread), 1 rank
  ray            one raydl StepLoader, data.backend=ray (Ray Data read tasks, one execution for several epochs), 1 rank
  arrow-remote, ray-remote   the same two, reading a copy of the dataset at --remote (a bucket: object-store
                 latency and bandwidth, which the loaders' prefetch is there to hide); their ratio to the
                 local read is printed too
Each variant runs in its own process; the first epoch is cold (for ray it includes starting
Ray's worker processes), the median of the rest is the run's rows/s. The variants alternate for
--repeats runs; prints each variant's median rows/s and its ratio to pyarrow's (ratio of medians, and the
median of each round's ratio, which a drift in the machine's speed between rounds moves less),
and the data-wait share of training runs' summary.json; writes --out (JSON).

Then, for each --dp, dp processes at once, one per data-parallel rank (arrow backend), each reading one
epoch as its rank: the bytes each decoded (the decoded tables' buffer sizes) as a share of decoding the
whole dataset once, against the goal 1/dp + 0.10 (issue 15: a rank decodes only the rows it trains on);
and the same share for data.backend=ray, computed from the row groups its read plan gives each rank.
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
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from raydl.bench import harness
from raydl.errors import ConfigError

VARIANTS = ("pyarrow", "arrow", "ray")   # pyarrow first: the others are divided by it
REMOTE = "-remote"   # a variant reading the copy at --remote


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

    fs = pafs.LocalFileSystem()
    splits = {"train": write_split(fs, str(tmp), "train", tables(0, rows), shard_rows=3200),
              "eval": write_split(fs, str(tmp), "eval", tables(rows, rows + 256), shard_rows=3200)}
    write_manifest(fs, str(tmp), {"task": "tokens", "vocab_size": 50257, "seq_len": seq_len}, splits)
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


def copy_to_remote(path: Path, remote: str) -> None:
    """The benchmark dataset at `remote` too (once): shards first, the manifest last, as prepare writes it."""
    from raydl import storage

    fs, root = storage.check(remote, "--remote")
    if not storage.exists(fs, f"{root}/manifest.json"):
        storage.upload_dir(str(path), fs, root, last="manifest.json")


def epochs_loader(path: Path | str, batch: int, backend: str, epochs: int) -> tuple[int, list[float]]:
    """One loader over `epochs` epochs, as training uses it: (rows per epoch, seconds per epoch)."""
    from raydl.data.dataset import open_dataset
    from raydl.data.loader import StepLoader, epoch_steps
    from raydl.data.order import DataPosition

    info = open_dataset(str(path))
    per_epoch = epoch_steps(info, batch)
    loader = StepLoader(info, global_batch=batch, dp_rank=0, dp_size=1, seed=0, shuffle=True, position=DataPosition(0, 0),
                        prefetch=2, backend=backend, steps=epochs * per_epoch)
    steps, times = iter(loader), []
    for _ in range(epochs):
        t0, rows = time.perf_counter(), 0
        for _ in range(per_epoch):
            rows += len(next(steps).tensors["input_ids"])
        times.append(time.perf_counter() - t0)
    return rows, times


def rank_epoch(path: Path, batch: int, dp_rank: int, dp_size: int) -> dict[str, Any]:
    """In this process: one epoch as data-parallel rank `dp_rank` of `dp_size` (arrow backend, no read-ahead,
    so that what was decoded is this epoch's): rows, seconds and bytes decoded."""
    from raydl.data.dataset import open_dataset
    from raydl.data.loader import StepLoader
    from raydl.data.order import DataPosition

    loader = StepLoader(open_dataset(str(path)), global_batch=batch, dp_rank=dp_rank, dp_size=dp_size, seed=0,
                        shuffle=True, position=DataPosition(0, 0), prefetch=0, backend="arrow")
    t0 = time.perf_counter()
    rows = sum(len(step.tensors["input_ids"]) for _, step in zip(range(loader.steps_per_epoch), loader))
    return {"rows": rows, "epoch_s": time.perf_counter() - t0, "decoded_bytes": loader.reader.decoded_bytes}


def row_group_bytes(path: Path) -> list[int]:
    """Decoded bytes of each train row group, numbered as raydl.data.order numbers them."""
    import pyarrow.parquet as pq

    from raydl.data.dataset import open_dataset

    files = map(pq.ParquetFile, open_dataset(str(path)).shard_paths["train"])
    return [f.read_row_group(i).get_total_buffer_size() for f in files for i in range(f.num_row_groups)]


def dataset_decoded_bytes(path: Path) -> int:
    """Decoding every train row group once: what a rank's decoded bytes are a share of."""
    return sum(row_group_bytes(path))


def ray_planned_bytes(path: Path, batch: int, dp_rank: int, dp_size: int, sizes: list[int]) -> int:
    """data.backend=ray: what the read tasks of one rank decode in epoch 0, from the reads they are given (each
    decodes its whole row group). Computed, not timed: no Ray cluster is started."""
    from raydl.data.dataset import open_dataset
    from raydl.data.order import DataPosition
    from raydl.data.ray_source import PlannedParquet, RankPlan

    plan = RankPlan(open_dataset(str(path)), "train", 0, True, batch, dp_rank, dp_size)
    position, decoded = DataPosition(), 0
    while position.epoch == 0:
        source = PlannedParquet(plan, position, tag_epoch=False)
        decoded += sum(sizes[read.group] for read in source.reads if read.epoch == 0)
        position = source.end
    return decoded


def decode_shares(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Per --dp: dp rank processes at once, one epoch each; their decoded bytes as a share of the dataset's."""
    sizes = row_group_bytes(path)
    total, out = sum(sizes), {}
    for dp in args.dp:
        procs = [subprocess.Popen(own_command(args, "--rank", f"{r}/{dp}"), env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(dp)]
        ranks = [last_json_line(p, f"dp={dp} rank {r}") for r, p in enumerate(procs)]
        shares, goal = [r["decoded_bytes"] / total for r in ranks], 1 / dp + 0.10
        print(f"[bench] dp={dp}: each rank decoded {', '.join(f'{s:.3f}' for s in shares)} of the dataset "
              f"(goal <= {goal:.2f}: {'met' if max(shares) <= goal else 'NOT met'})", flush=True)
        ray_shares = [ray_planned_bytes(path, args.batch, r, dp, sizes) / total for r in range(dp)]
        print(f"[bench] dp={dp}, data.backend=ray (from its read plan): {', '.join(f'{s:.3f}' for s in ray_shares)}",
              flush=True)
        out[str(dp)] = {"decoded_share": shares, "goal": goal, "met": max(shares) <= goal, "ranks": ranks,
                        "ray_planned_share": ray_shares}
    return {"dataset_decoded_bytes": total, "by_dp": out}


def run_variant(variant: str, path: Path | str, batch: int, epochs: int) -> dict[str, Any]:
    """In this process: `epochs` timed epochs of one variant (`path`: the dataset it reads, local or remote)."""
    import torch

    torch.set_num_threads(1)
    if variant.startswith("ray"):
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    if variant == "pyarrow":
        times = []
        for _ in range(epochs):
            t0 = time.perf_counter()
            rows = epoch_pyarrow(path, batch)
            times.append(time.perf_counter() - t0)
    else:
        rows, times = epochs_loader(path, batch, variant.removesuffix(REMOTE), epochs)
    warm = statistics.median(times[1:] or times)
    return {"rows_per_s": rows / warm, "warm_epoch_s": warm, "cold_epoch_s": times[0], "rows": rows, "epoch_s": times}


def variant_side(variant: str, args: argparse.Namespace) -> harness.Side:
    """One run of `variant` in a process of its own (a fresh interpreter: no warm caches from the others)."""
    cmd = own_command(args, "--variant", variant)

    def side() -> dict[str, Any]:
        p = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        return last_json_line(p, f"variant {variant}")
    return side


def own_command(args: argparse.Namespace, *internal: str) -> list[str]:
    """This benchmark, on the same dataset, for one internal part (a variant, a rank) in a process of its own."""
    remote = ["--remote", args.remote] if args.remote else []
    return [sys.executable, "-m", "raydl.bench.ingest", *internal, "--rows", str(args.rows), "--seq-len",
            str(args.seq_len), "--batch", str(args.batch), "--epochs", str(args.epochs), "--dir", args.dir, *remote]


def last_json_line(p: subprocess.Popen, what: str) -> dict[str, Any]:
    stdout, stderr = p.communicate()
    if p.returncode:
        raise RuntimeError(f"[bench] ingest {what} failed:\n{stderr[-2000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def dp_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError("--dp", f"is '{text}'", "give data-parallel sizes separated by commas, e.g. 2,4")
    return sizes


def data_wait_shares(summary_paths: list[str]) -> dict[str, float]:
    shares = {path: json.loads(Path(path).read_text())["data_wait_frac"] for path in summary_paths}
    for path, share in shares.items():
        print(f"[bench] data-wait share of step time ({path}): {100 * share:.3f}%")
    return shares


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("ingest", __doc__)
    p.add_argument("--rows", type=int, default=51200)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=256, help="Rows per batch (the loader's global batch).")
    p.add_argument("--epochs", type=int, default=6, help="Epochs per variant and run; the first is cold.")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--dir", default="/tmp/raydl-bench", help="Where the benchmark dataset is generated.")
    p.add_argument("--summary", nargs="*", default=[], help="Training runs' summary.json files, for their data-wait share.")
    p.add_argument("--dp", type=dp_sizes, default=[2, 4],
                   help="Data-parallel sizes whose per-rank decoded bytes are measured (one process per rank).")
    p.add_argument("--remote", help="Also time the arrow and ray variants reading a copy of the dataset at this "
                   "URI (s3://BUCKET/PATH; the endpoint from AWS_ENDPOINT_URL), made once.")
    p.add_argument("--variant", help=argparse.SUPPRESS)   # internal: run one variant in this process
    p.add_argument("--rank", help=argparse.SUPPRESS)      # internal: one epoch as rank R/DP in this process
    args = harness.parse_args(p, argv)
    if args.epochs < 1:
        raise ConfigError("--epochs", f"is {args.epochs}", "use at least 1 (2 or more: the first is cold)")
    if bad := [dp for dp in args.dp if args.batch % dp]:
        raise ConfigError("--dp", f"has {bad[0]}, which does not divide --batch {args.batch}",
                          "use data-parallel sizes that divide the global batch")
    path = make_dataset(Path(args.dir), args.rows, args.seq_len)
    if args.variant:
        source = args.remote if args.variant.endswith(REMOTE) else path
        print(json.dumps(run_variant(args.variant, source, args.batch, args.epochs)))
        return 0
    if args.rank:
        dp_rank, dp_size = map(int, args.rank.split("/"))
        print(json.dumps(rank_epoch(path, args.batch, dp_rank, dp_size)))
        return 0
    session = harness.Session("ingest", args)
    variants = ["pyarrow", *(v for v in args.variants if v != "pyarrow")]
    if args.remote:
        copy_to_remote(path, args.remote)
        variants += [v + REMOTE for v in variants if v != "pyarrow"]
    runs = harness.alternate({v: variant_side(v, args) for v in variants}, args.repeats)
    rates = {v: [r["rows_per_s"] for r in variant_runs] for v, variant_runs in runs.items()}
    ratios = {v: harness.ratio_of_medians(rates[v], rates["pyarrow"]) for v in variants}
    paired = {v: harness.paired_ratios(rates[v], rates["pyarrow"]) for v in variants}
    for v in variants:
        print(harness.describe(v, harness.summary(rates[v]), " rows/s") + f"; ratio to pyarrow {ratios[v]:.2f}")
        print(harness.describe(f"  {v} / pyarrow, round by round", paired[v]))
    remote = {v: harness.ratio_of_medians(rates[v + REMOTE], rates[v]) for v in variants if v + REMOTE in rates}
    for v, ratio in remote.items():
        print(f"[bench] {v} reading --remote: {ratio:.2f} of its rows/s reading the local copy")
    size = sum(f.stat().st_size for f in path.glob("train-*.parquet"))
    session.write(dataset={"path": str(path), "rows": args.rows, "seq_len": args.seq_len, "batch": args.batch,
                           "raw_mb": args.rows * args.seq_len * 4 * 2 / 1e6, "disk_mb": size / 1e6},
                  variants={v: harness.summarize(variant_runs) for v, variant_runs in runs.items()},
                  ratio_to_pyarrow=ratios, paired_ratio_to_pyarrow=paired, remote=args.remote,
                  remote_to_local=remote, training_data_wait_frac=data_wait_shares(args.summary),
                  decoded_per_rank=decode_shares(args, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
