"""raydl bench packing: records of mixed lengths, packed rows vs one record per padded row, equal target tokens.

The same records (log-normal lengths, median --median tokens, sigma 1, clipped to 4..--seq-len; each an arithmetic
progression mod the vocabulary with its own stride, so a record is learnt from its own tokens only, a tenth of its
tokens replaced at random, so that the loss has a floor) are trained for
--epochs from the same initial weights by raydl's own engine (one process, fp32): "padded" holds one record per row,
padded to --seq-len as the loader pads it; "packed" holds the rows `raydl data prepare --pack` makes
(raydl.data.packing), with their document ids, and as many rows per step as carry the same target tokens as the
padded side's --rows (so both take about the same optimizer steps over the same tokens). Reported per side: target
tokens trained per second of step time, and the final loss: the eval loss over held-out records, each alone in a
padded row, the same for both sides. Sides alternate; both sides of a round see their rows in the order of that
round's seed (so the final loss's spread over the rounds is the data order's).

    raydl bench packing --repeats 5         # raydl's gpt, 2 layers x 64; --model llama: a Hugging Face Llama
"""

from __future__ import annotations

import math
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from raydl.bench import harness

SIDES = ("padded", "packed")
MODELS = {"gpt": ("model.size=tiny", "model.options.layers=2", "model.options.width=64"),
          "llama": ("model.name=hf", "model.options.hidden_size=64", "model.options.num_hidden_layers=2")}
VOCAB = 64
NOISE = 0.1
LR = 3e-3


def records(count: int, *, median: float, seq_len: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per record: tokens start + stride * i mod VOCAB, NOISE of them random; the first two
    unlearnt (the stride is unknown until two tokens are seen)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(median), 1.0, count).round(), 4, seq_len).astype(int)
    out = []
    for length in lengths:
        start, stride = rng.integers(VOCAB), rng.integers(1, 5)
        tokens = (start + stride * np.arange(length + 1)) % VOCAB
        noisy = rng.random(length + 1) < NOISE
        tokens = np.where(noisy, rng.integers(VOCAB, size=length + 1), tokens).tolist()
        out.append((tokens[:-1], [-100, *tokens[2:]]))
    return out


def batches(rows, rows_per_step: int, meta: dict, seed: int) -> list[dict]:
    """The rows (a table) shuffled and cut into steps of `rows_per_step`, as the loader's tensors."""
    from raydl.data.loader import to_tensors

    order = np.random.default_rng(seed).permutation(rows.num_rows)
    steps = rows.num_rows // rows_per_step
    return [to_tensors(rows.take(order[i * rows_per_step:(i + 1) * rows_per_step]), meta) for i in range(steps)]


def one_per_row(recs) -> Any:
    import pyarrow as pa

    kind = pa.list_(pa.int32())
    return pa.table({"input_ids": pa.array([r[0] for r in recs], kind), "labels": pa.array([r[1] for r in recs], kind)})


def engine_for(model: str, meta: dict, rows_per_step: int):
    import torch

    from raydl.models.choice import choose_model
    from raydl.overrides import load_config
    from raydl.parallel.mesh import layout_for
    from raydl.train.engines import DataParallelEngine
    from raydl.train.model_build import build_for_worker

    cfg = load_config(None, [*MODELS[model], f"train.global_batch_size={rows_per_step}",
                             f"train.micro_batch_size={rows_per_step}", "train.seed=0"])
    chosen = choose_model(cfg.model)
    built, init = build_for_worker(chosen, meta, cfg)
    session = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    engine = DataParallelEngine(built, layout_for(cfg, 1, num_blocks=len(built.blocks)), cfg, chosen.spec, session,
                                None, init)
    return engine, torch.optim.AdamW(engine.parameters(), lr=LR)


def run_side(side: str, data: dict, args, round_: int) -> dict[str, float]:
    """One side's run: its rows in the order of seed `round_` (both sides of a round alike), from the same
    initial weights."""
    import torch

    torch.manual_seed(0)
    engine, optimizer = engine_for(args.model, data["meta"], data["rows"][side])
    steps, seconds, targets = 0, 0.0, 0
    for epoch in range(args.epochs):
        for batch in batches(data["tables"][side], data["rows"][side], data["meta"], seed=1000 * round_ + epoch):
            start = time.perf_counter()
            engine.forward_backward(batch, scaler=None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds += time.perf_counter() - start
            steps += 1
            targets += int((batch["labels"][batch["labels_mask"]] != -100).sum())
    final = engine.evaluate(data["eval"], precision="fp32")["loss"]
    return {"target_tokens_per_s": targets / seconds, "final_loss": final, "steps": steps, "seconds": seconds,
            "target_tokens": targets}


def prepare_data(args) -> dict[str, Any]:
    import pyarrow as pa

    from raydl.data.packing import packed_tables

    meta = {"vocab_size": VOCAB, "seq_len": args.seq_len}
    train = records(args.records, median=args.median, seq_len=args.seq_len, seed=1)
    held_out = records(256, median=args.median, seq_len=args.seq_len, seed=2)
    tables = {"padded": one_per_row(train), "packed": pa.concat_tables(packed_tables(iter(train), args.seq_len))}
    real = sum(len(ids) for ids, _ in train)
    fill = real / (tables["packed"].num_rows * args.seq_len)
    rows = {"padded": args.rows, "packed": max(1, round(args.rows * tables["packed"].num_rows / len(train)))}
    return {"meta": meta, "rows": rows, "fill": {"padded": real / (len(train) * args.seq_len), "packed": fill},
            "tables": tables, "eval": batches(one_per_row(held_out), 32, meta, seed=0)}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("packing", __doc__)
    p.add_argument("--model", choices=tuple(MODELS), default="gpt", help="gpt: raydl's gpt (2 layers, width 64); "
                   "llama: the Hugging Face Llama (hidden 64, 2 layers; needs raydl[hf]).")
    p.add_argument("--records", type=int, default=2000, help="Training records.")
    p.add_argument("--median", type=float, default=12, help="Median record length in tokens.")
    p.add_argument("--seq-len", type=int, default=64, help="Row length (prepare's --seq-len).")
    p.add_argument("--rows", type=int, default=32, help="Padded rows per step; the packed side takes as many rows "
                   "as hold the same records on average.")
    p.add_argument("--epochs", type=int, default=6, help="Epochs over the records, per side.")
    args = harness.parse_args(p, argv)
    import torch

    torch.set_num_threads(1)
    session = harness.Session("packing", args)
    data = prepare_data(args)
    rounds = {side: iter(range(args.repeats)) for side in SIDES}
    runs = harness.alternate({side: (lambda side=side: run_side(side, data, args, next(rounds[side])))
                              for side in SIDES}, args.repeats)
    stats = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
    speed = [[r["target_tokens_per_s"] for r in runs[side]] for side in ("packed", "padded")]
    ratio = harness.ratio_of_medians(*speed)
    loss_ratio = harness.ratio_of_medians(*[[r["final_loss"] for r in runs[side]] for side in ("packed", "padded")])
    for side in SIDES:
        print(harness.describe(f"{side} target tokens/s", stats[side]["target_tokens_per_s"]) +
              f"; final loss {stats[side]['final_loss']['median']:.4f}; {data['fill'][side]:.1%} of slots real; "
              f"{data['rows'][side]} rows a step")
    print(f"packed / padded: target tokens/s {ratio:.2f}x, final loss {loss_ratio:.4f}")
    session.write(sides=stats, fill=data["fill"], rows_per_step=data["rows"], ratio_packed_over_padded={
        "target_tokens_per_s": ratio, "final_loss": loss_ratio,
        "paired_target_tokens_per_s": harness.paired_ratios(*speed)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
