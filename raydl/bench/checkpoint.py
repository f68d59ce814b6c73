"""Checkpoint save and restore time: a raydl checkpoint on local disk vs in a bucket (--remote).

    raydl bench checkpoint --remote s3://BUCKET/PATH [--size tiny] [--vocab 8192] [--repeats 5]

One rank's checkpoint of a GPT (model.size --size, AdamW state after one step) as training makes it:
  local    save: DCP shards, checksums and state into a directory; restore: verify it (every file hashed)
           and load it into a fresh model and optimizer
  remote   save: the same into a temp dir, then uploaded to --remote file by file (what Ray Train does at
           each checkpointed report); restore: downloaded (what Ray's Checkpoint.as_directory does at a
           worker group's restart), then verified and loaded
The sides alternate for --repeats rounds; prints the medians and the remote/local ratios; writes --out (JSON).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from raydl.bench import harness
from raydl.errors import ConfigError


def build(size: str, vocab: int):
    import torch

    from raydl.models.gpt import build_gpt

    torch.manual_seed(0)
    model = build_gpt(size, vocab_size=vocab, seq_len=128)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 128, dtype=torch.long)).float().mean().backward()
    optimizer.step()   # AdamW's moments exist: a checkpoint holds them as training's does
    return model, optimizer


def state() -> dict[str, Any]:
    return {"step": 1, "samples": 1, "position": {"epoch": 0, "offset": 1}, "model": {"name": "gpt"},
            "layout": {"world_size": 1, "dp": 1, "pp": 1}, "scaler": None, "lr": 0.0, "saved_by_ranks": 1}


def verify_and_load(path: str, model, optimizer) -> None:
    """What a restart does with the checkpoint it resumes from (raydl.train.checkpoint)."""
    from raydl.train import checkpoint as ckpt

    problem = ckpt.verify(path)
    if problem:
        raise RuntimeError(f"the benchmark's own checkpoint {path} does not verify: {problem}")
    ckpt.load(path, model, optimizer, {"name": "gpt"})


def timed(save, restore) -> dict[str, float]:
    t0 = time.perf_counter()
    save()
    t1 = time.perf_counter()
    restore()
    return {"save_s": t1 - t0, "restore_s": time.perf_counter() - t1}


def local_side(args) -> harness.Side:
    from raydl.train import checkpoint as ckpt

    model, optimizer = build(args.size, args.vocab)

    def side() -> dict[str, float]:
        path = tempfile.mkdtemp(prefix="raydl-bench-ckpt-")
        fresh, fresh_opt = build(args.size, args.vocab)
        try:
            return timed(lambda: ckpt.save(path, model, optimizer, state(), rank=0),
                         lambda: verify_and_load(path, fresh, fresh_opt))
        finally:
            shutil.rmtree(path, ignore_errors=True)
    return side


def remote_side(args) -> harness.Side:
    from raydl import storage
    from raydl.train import checkpoint as ckpt

    model, optimizer = build(args.size, args.vocab)
    fs, root = storage.check(args.remote, "--remote")

    def save(remote: str, path: str) -> None:
        ckpt.save(path, model, optimizer, state(), rank=0)
        storage.upload_dir(path, fs, remote)

    def restore(remote: str, fresh, fresh_opt) -> None:
        with storage.local_copy(storage.uri(fs, remote), "--remote") as local:
            verify_and_load(local, fresh, fresh_opt)

    def side() -> dict[str, float]:
        remote, path = f"{root}/step-{uuid.uuid4().hex[:8]}", tempfile.mkdtemp(prefix="raydl-bench-ckpt-")
        fresh, fresh_opt = build(args.size, args.vocab)
        try:
            return timed(lambda: save(remote, path), lambda: restore(remote, fresh, fresh_opt))
        finally:
            shutil.rmtree(path, ignore_errors=True)
            fs.delete_dir(remote)
    return side


def checkpoint_bytes(args) -> int:
    from raydl.train import checkpoint as ckpt

    model, optimizer = build(args.size, args.vocab)
    path = tempfile.mkdtemp(prefix="raydl-bench-ckpt-")
    try:
        ckpt.save(path, model, optimizer, state(), rank=0)
        return sum(f.stat().st_size for f in Path(path).iterdir())
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("checkpoint", __doc__)
    p.add_argument("--remote", help="Where the remote side saves: a URI (s3://BUCKET/PATH; the endpoint from "
                   "AWS_ENDPOINT_URL).")
    p.add_argument("--size", default="tiny", help="model.size of the GPT whose checkpoint is timed (default tiny).")
    p.add_argument("--vocab", type=int, default=8192, help="Its vocabulary (default 8192).")
    args = harness.parse_args(p, argv)
    if not args.remote:
        raise ConfigError("--remote", "is missing", "give the bucket to time against, e.g. --remote s3://BUCKET/bench")
    session = harness.Session("checkpoint", args)
    runs = harness.alternate({"local": local_side(args), "remote": remote_side(args)}, args.repeats)
    result: dict[str, Any] = {"checkpoint_mb": checkpoint_bytes(args) / 1e6, "remote": args.remote}
    for key in ("save_s", "restore_s"):
        times = {side: [r[key] for r in side_runs] for side, side_runs in runs.items()}
        for side, values in times.items():
            print(harness.describe(f"{side} {key}", harness.summary(values), " s"))
        result[key] = {side: harness.summary(values) for side, values in times.items()}
        result[f"{key}_remote_to_local"] = harness.ratio_of_medians(times["remote"], times["local"])
    print(f"[bench] checkpoint of {result['checkpoint_mb']:.1f} MB: save {result['save_s_remote_to_local']:.2f}x, "
          f"restore {result['restore_s_remote_to_local']:.2f}x the local time")
    session.write(**result)
    return 0
