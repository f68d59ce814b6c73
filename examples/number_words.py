"""Chat records of numbers written in words, answered in digits, with held-out numbers drawn apart.

    python examples/number_words.py --out chat.jsonl --held-out held.jsonl --records 3000

"What is three hundred forty-seven in digits?" -> "347". A rule a model pre-trained on other text cannot know,
and one that a small model can learn from other numbers (each word stands for a digit in its place), so exact
match on numbers no training record holds measures what fine-tuning taught (docs/finetune.md).
Deterministic for a --seed.
"""

from __future__ import annotations

import argparse
import json
import random

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
       "seventeen eighteen nineteen".split()
TENS = {20: "twenty", 30: "thirty", 40: "forty", 50: "fifty", 60: "sixty", 70: "seventy", 80: "eighty", 90: "ninety"}


def words(n: int) -> str:
    """0 <= n < 1000 in words: 'three hundred forty-seven'."""
    hundreds, rest = divmod(n, 100)
    if hundreds:
        return f"{ONES[hundreds]} hundred" + (f" {words(rest)}" if rest else "")
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    return TENS[tens * 10] + (f"-{ONES[ones]}" if ones else "")


def record(n: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {words(n)} in digits?"},
                         {"role": "assistant", "content": str(n)}]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Training records (jsonl).")
    p.add_argument("--held-out", required=True, help="Held-out records (jsonl), numbers not in --out.")
    p.add_argument("--records", type=int, default=3000, help="Training records (drawn with repetition).")
    p.add_argument("--held-out-records", type=int, default=100)
    p.add_argument("--limit", type=int, default=1000, help="Numbers below this (<= 1000).")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    numbers = list(range(min(args.limit, 1000)))
    rng.shuffle(numbers)
    held, train = numbers[:args.held_out_records], numbers[args.held_out_records:]
    with open(args.out, "w") as f:
        f.writelines(json.dumps(record(rng.choice(train))) + "\n" for _ in range(args.records))
    with open(args.held_out, "w") as f:
        f.writelines(json.dumps(record(n)) + "\n" for n in held)


if __name__ == "__main__":
    main()
