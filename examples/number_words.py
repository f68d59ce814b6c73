"""Chat records of arithmetic in words, with held-out records drawn apart (no pair of numbers in both).

    python examples/arithmetic_words.py --out chat.jsonl --held-out held.jsonl --records 2000

"What is seven plus five?" -> "twelve". A rule a model pre-trained on other text cannot know, so exact match on
the held-out questions measures what fine-tuning taught (docs/finetune.md). Deterministic for a --seed.
"""

from __future__ import annotations

import argparse
import json
import random

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
       "seventeen eighteen nineteen".split()
TENS = {20: "twenty", 30: "thirty", 40: "forty", 50: "fifty", 60: "sixty", 70: "seventy", 80: "eighty", 90: "ninety"}


def words(n: int) -> str:
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    return TENS[tens * 10] + (f"-{ONES[ones]}" if ones else "")


def record(a: int, b: int, op: str) -> dict:
    answer = a + b if op == "plus" else a - b
    return {"messages": [{"role": "user", "content": f"What is {words(a)} {op} {words(b)}?"},
                         {"role": "assistant", "content": words(answer)}]}


def pairs(limit: int) -> list[tuple[int, int, str]]:
    """Every question whose operands and answer lie in 0..limit-1."""
    return [(a, b, op) for a in range(limit) for b in range(limit) for op in ("plus", "minus")
            if 0 <= (a + b if op == "plus" else a - b) < limit]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Training records (jsonl).")
    p.add_argument("--held-out", required=True, help="Held-out records (jsonl), questions not in --out.")
    p.add_argument("--records", type=int, default=2000, help="Training records (drawn with repetition).")
    p.add_argument("--held-out-records", type=int, default=100)
    p.add_argument("--limit", type=int, default=100, help="Operands and answers below this number (<= 100).")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    questions = pairs(min(args.limit, 100))
    rng.shuffle(questions)
    held, train = questions[:args.held_out_records], questions[args.held_out_records:]
    with open(args.out, "w") as f:
        f.writelines(json.dumps(record(*rng.choice(train))) + "\n" for _ in range(args.records))
    with open(args.held_out, "w") as f:
        f.writelines(json.dumps(record(*q)) + "\n" for q in held)


if __name__ == "__main__":
    main()
