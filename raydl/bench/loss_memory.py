"""raydl bench loss_memory: the token cross-entropy's peak memory and time at GPT-2's head, whole logits vs chunked.

One forward and backward of the loss alone on GPT-2 124M's head (hidden 768, vocabulary 50304), fp32, a quarter of
the labels -100: `token_cross_entropy` on the whole logits (what a model's forward followed by the loss holds) against
`chunked_cross_entropy` (raydl.models.loss, what raydl's gpt and Hugging Face models use). Each side is a fresh
process, alternating per round; reported: its peak RSS above the process after its inputs were made (Linux's VmHWM,
reset through /proc/self/clear_refs), its wall time, and what the memory prediction counts for each side
(raydl.parallel.memory: the logits' log-probabilities and their gradient, or the hidden states kept and one chunk).

    raydl bench loss_memory --repeats 3 --tokens 4096      # 4 x 1024 tokens: 786 MiB of fp32 logits
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from raydl.bench import harness

WIDTH, VOCAB = 768, 50304
SIDES = ("whole", "chunked")


def _kib(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1])


def measure(side: str, tokens: int) -> dict[str, float]:
    """In this process: the side's loss forward and backward; its peak RSS above the RSS before it, in MiB."""
    import torch

    from raydl.models.loss import chunked_cross_entropy, token_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(tokens, WIDTH, requires_grad=True)
    head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
    labels = torch.randint(VOCAB, (tokens,))
    labels[torch.rand(tokens) < 0.25] = -100
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    before_kib, start = _kib("VmRSS"), time.perf_counter()
    total, count = (chunked_cross_entropy(hidden, head, labels) if side == "chunked"
                    else token_cross_entropy(head(hidden), labels))
    total.backward()
    seconds = time.perf_counter() - start
    return {"peak_above_mib": (_kib("VmHWM") - before_kib) / 1024, "seconds": seconds,
            "loss_per_token": float(total) / int(count)}


def predicted_mib(side: str, tokens: int) -> float:
    """What raydl.parallel.memory adds for the loss of `tokens` tokens on top of the head's activations."""
    from raydl.models.loss import chunk_bytes

    if side == "whole":
        return 2 * tokens * VOCAB * 4 / 2**20                      # log-probabilities, and their gradient
    return (tokens * (WIDTH * 4 + 12) + chunk_bytes(VOCAB)) / 2**20   # hidden states, labels, lse; one chunk


def one_run(side: str, tokens: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "raydl.bench.loss_memory", "--side", side, "--tokens", str(tokens)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("loss_memory", __doc__)
    p.add_argument("--tokens", type=int, default=4096, help="Tokens in the micro-batch (rows x sequence length).")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)   # a side's own process
    args = harness.parse_args(p, argv)
    if args.side:
        print(json.dumps(measure(args.side, args.tokens)))
        return 0
    session = harness.Session("loss_memory", args)
    runs = harness.alternate({side: (lambda side=side: one_run(side, args.tokens)) for side in SIDES}, args.repeats)
    stats: dict[str, Any] = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
    ratios = {key: harness.ratio_of_medians([r[key] for r in runs["chunked"]], [r[key] for r in runs["whole"]])
              for key in ("peak_above_mib", "seconds")}
    predicted = {side: predicted_mib(side, args.tokens) for side in SIDES}
    for side in SIDES:
        print(harness.describe(f"{side} peak above start", stats[side]["peak_above_mib"], " MiB")
              + f" (predicted {predicted[side]:,.0f} MiB)")
        print(harness.describe(f"{side} time", stats[side]["seconds"], " s"))
    print(f"chunked / whole: peak {ratios['peak_above_mib']:.3f}, time {ratios['seconds']:.3f}")
    session.write(tokens=args.tokens, width=WIDTH, vocab=VOCAB, sides=stats, predicted_mib=predicted,
                  ratio_chunked_over_whole=ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
