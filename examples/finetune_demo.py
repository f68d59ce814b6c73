"""Fine-tuning, demonstrated end to end with nothing downloaded: a small Llama pre-trained on text, then fine-tuned
from those weights (train.init_from) on arithmetic-in-words chat records, exact match on held-out questions before
and after.

    python examples/finetune_demo.py --dir /tmp/demo                          # defaults: a few minutes on 2 cores
    python examples/finetune_demo.py --dir /tmp/demo --finetune-steps 600 --records 4000

Steps, each a raydl command (printed as it runs):
1. a tokenizer directory with a ChatML template (tests/chat_tokenizer.py), BPE trained on the text and the records
2. `raydl data prepare --from text` of the pre-training text (Python's own library sources, shipped with Python)
3. `raydl data prepare --from jsonl --format chat` of the records (examples/arithmetic_words.py; held-out questions
   drawn apart)
4. `raydl train` pre-training, then `raydl generate --eval` on the held-out records (with the chat template)
5. `raydl train --set train.init_from=<pre-training run>`, then `raydl generate --eval` again
Prints a JSON summary: exact match before and after, the share of answers ending with the end-of-turn token, and
the wall time of each step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["model.name=hf", "model.options.family=llama", "model.options.layers=4", "model.options.hidden_size=128",
         "model.options.kv_heads=2", "scaling.min_workers=2", "scaling.max_workers=2", "train.micro_batch_size=16",
         "train.global_batch_size=32", "telemetry.progress=false", "checkpoint.every_steps=100"]


def run(cmd: list[str], log: list[dict], what: str) -> str:
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    log.append({"step": what, "wall_s": round(time.monotonic() - t0, 1)})
    if done.returncode:
        sys.exit(f"{what} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def sets(*values: str) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="Working directory (created; must be new).")
    p.add_argument("--pretrain-steps", type=int, default=200)
    p.add_argument("--finetune-steps", type=int, default=300)
    p.add_argument("--records", type=int, default=3000)
    p.add_argument("--held-out", type=int, default=100)
    p.add_argument("--limit", type=int, default=100, help="Operands and answers below this number (<= 100).")
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    work = Path(args.dir).resolve()
    work.mkdir(parents=True)
    sys.path.insert(0, str(REPO))
    from tests.chat_tokenizer import SAMPLE_TEXT, make_tokenizer_dir

    log: list[dict] = []
    corpus = "\n".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py")))
    (work / "corpus.txt").write_text(corpus)
    raydl = [str(Path(sys.executable).parent / "raydl")]
    run([sys.executable, "examples/arithmetic_words.py", "--out", str(work / "chat.jsonl"), "--held-out",
         str(work / "held.jsonl"), "--records", str(args.records), "--held-out-records", str(args.held_out),
         "--limit", str(args.limit)],
        log, "records")
    make_tokenizer_dir(work / "tok", texts=[corpus, SAMPLE_TEXT, (work / "chat.jsonl").read_text()], vocab_size=1024)
    run([*raydl, "-q", "data", "prepare", str(work / "corpus.txt"), "--from", "text", "--tokenizer",
         str(work / "tok" / "tokenizer.json"), "--seq-len", "64", "--out", str(work / "text")], log, "prepare text")
    run([*raydl, "-q", "data", "prepare", str(work / "chat.jsonl"), "--from", "jsonl", "--format", "chat",
         "--tokenizer", str(work / "tok"), "--seq-len", "64", "--out", str(work / "chat")], log, "prepare records")
    run([*raydl, "-q", "train", *sets(*MODEL, f"data.path={work / 'text'}", f"train.max_steps={args.pretrain_steps}",
                                      f"train.lr={args.lr}", f"run.dir={work / 'pre'}")], log, "pre-train")
    def score(run_dir: Path, *extra: str) -> dict:
        return json.loads(run([*raydl, "generate", str(run_dir), "--eval", str(work / "held.jsonl"),
                               "--max-new-tokens", "8", "--json", *extra], log, f"exact match of {run_dir.name}"))

    before = score(work / "pre", "--tokenizer", str(work / "tok"), "--template", "chat")
    run([*raydl, "-q", "train", *sets(*MODEL, f"data.path={work / 'chat'}", f"train.max_steps={args.finetune_steps}",
                                      f"train.lr={args.lr}", f"train.init_from={work / 'pre'}",
                                      f"run.dir={work / 'fine'}")], log, "fine-tune")
    after = score(work / "fine")
    print(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                      "held_out_records": after["records"], "exact_match_before": before["exact_match"],
                      "exact_match_after": after["exact_match"],
                      "ended_with_end_token_after": after["ended_with_end_token"], "examples_after": after["examples"],
                      "steps": log}, indent=1))


if __name__ == "__main__":
    main()
