"""Fine-tuning, demonstrated end to end with nothing downloaded: a small Llama pre-trained on text, then fine-tuned
from those weights (train.init_from) on chat records of numbers in words answered in digits, exact match on
held-out numbers before and after.

    python examples/finetune_demo.py --dir /tmp/demo                          # about 2.5 minutes on 2 cores
    python examples/finetune_demo.py --dir /tmp/demo --variants padded packed lora
    python examples/finetune_demo.py --dir /tmp/demo --kill-worker-at 150     # and again with a worker killed

Steps, each a raydl command (printed as it runs):
1. a tokenizer directory with a ChatML template, one token per digit (tests/chat_tokenizer.py), BPE trained on the
   text and the records
2. `raydl data prepare --from text` of the pre-training text (Python's own library sources, shipped with Python)
3. `raydl data prepare --from jsonl --format chat` of the records (examples/number_words.py; held-out numbers
   drawn apart)
4. `raydl train` pre-training, then `raydl generate --eval` on the held-out records (with the chat template)
5. per variant, `raydl train --set train.init_from=<pre-training run>`, then `raydl generate --eval` again:
   padded  the whole model, one record per row of 64 tokens, 32 rows a step
   packed  the whole model, records packed into the rows of 64 tokens (3 a row), 10 rows a step (30 records)
   lora    rank-8 LoRA adapters on every linear layer (train.lora), the base frozen; padded rows as above
6. with --kill-worker-at STEP: the first variant again, one Train worker SIGKILLed once the run has reported STEP;
   the sample ids each run trained on (debug.ledger_dir) and the exact match are compared
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
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["model.name=hf", "model.options.family=llama", "model.options.layers=4", "model.options.hidden_size=128",
         "model.options.kv_heads=2", "scaling.min_workers=2", "scaling.max_workers=2", "telemetry.progress=false",
         "checkpoint.every_steps=100"]
# variant: (dataset, prepare's arguments, fine-tuning's settings)
VARIANTS = {
    "padded": ("data-padded", ["--seq-len", "64", "--no-pack"], ["train.micro_batch_size=16", "train.global_batch_size=32"]),
    "packed": ("data-packed", ["--seq-len", "64", "--pack"], ["train.micro_batch_size=5", "train.global_batch_size=10"]),
    "lora": ("data-padded", ["--seq-len", "64", "--no-pack"], ["train.micro_batch_size=16", "train.global_batch_size=32",
                                                        "train.lora.rank=8"]),
}
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
RAYDL = str(Path(sys.executable).parent / "raydl")


def run(cmd: list[str], log: list[dict], what: str) -> str:
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, env=ENV)
    log.append({"step": what, "wall_s": round(time.monotonic() - t0, 1)})
    if done.returncode:
        sys.exit(f"{what} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def run_killing_a_worker(cmd: list[str], run_dir: Path, at_step: int, log: list[dict], what: str) -> int:
    """`raydl train` with one of its Train workers SIGKILLed once the run has reported `at_step`; the step killed at."""
    from raydl.bench.fault_cluster import train_workers
    from raydl.bench.procs import kill

    print("$", " ".join(cmd), f"   # a worker killed after step {at_step}", flush=True)
    t0 = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}.console", "w") as console:
        proc = subprocess.Popen(cmd, cwd=REPO, text=True, stdout=console, stderr=subprocess.STDOUT, env=ENV)
        while (step := _last_step(run_dir / "metrics.jsonl")) < at_step:
            if proc.poll() is not None:
                sys.exit(f"{what} ended ({proc.returncode}) before step {at_step}: see {console.name}")
            time.sleep(0.2)
        kill(train_workers(proc.pid)[-1])
        if proc.wait():
            sys.exit(f"{what} failed ({proc.returncode}): see {console.name}")
    log.append({"step": what, "wall_s": round(time.monotonic() - t0, 1)})
    return step


def _last_step(metrics: Path) -> int:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def sets(*values: str) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def samples_seen(ledger: Path) -> Counter:
    """How many times each sample id (a row: of several records when packed) was trained on, over the steps that
    count (raydl.data.ledger_read)."""
    from raydl.data.ledger_read import committed_ids

    return Counter(i for ids in committed_ids(ledger).values() for i in ids)


def prepare(work: Path, args, log: list[dict]) -> None:
    """The records, the tokenizer, and every dataset the variants train on."""
    from tests.chat_tokenizer import SAMPLE_TEXT, make_tokenizer_dir

    corpus = "\n".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py")))
    (work / "corpus.txt").write_text(corpus)
    run([sys.executable, "examples/number_words.py", "--out", str(work / "chat.jsonl"), "--held-out",
         str(work / "held.jsonl"), "--records", str(args.records), "--held-out-records", str(args.held_out),
         "--seed", str(args.seed)], log, "records")
    make_tokenizer_dir(work / "tok", texts=[corpus, SAMPLE_TEXT, (work / "chat.jsonl").read_text()], vocab_size=1024,
                       split_digits=True)
    run([RAYDL, "-q", "data", "prepare", str(work / "corpus.txt"), "--from", "text", "--tokenizer",
         str(work / "tok" / "tokenizer.json"), "--seq-len", "64", "--out", str(work / "text")], log, "prepare text")
    for dataset, prepare_args, _ in {VARIANTS[v][0]: VARIANTS[v] for v in args.variants}.values():
        run([RAYDL, "-q", "data", "prepare", str(work / "chat.jsonl"), "--from", "jsonl", "--format", "chat",
             "--tokenizer", str(work / "tok"), *prepare_args, "--out", str(work / dataset)], log, f"prepare {dataset}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="Working directory (created; must be new).")
    p.add_argument("--pretrain-steps", type=int, default=200)
    p.add_argument("--finetune-steps", type=int, default=300)
    p.add_argument("--records", type=int, default=3000)
    p.add_argument("--held-out", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="The records' draw and every run's train.seed.")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["padded"],
                   help="How to fine-tune (above); each from the same pre-trained weights.")
    p.add_argument("--kill-worker-at", type=int, default=0, help="Fine-tune the first variant again with a worker "
                   "killed after this step, and compare (0 = not).")
    args = p.parse_args()
    work = Path(args.dir).resolve()
    work.mkdir(parents=True)
    sys.path.insert(0, str(REPO))
    log: list[dict] = []
    prepare(work, args, log)
    common = [*MODEL, f"train.lr={args.lr}", f"train.seed={args.seed}"]
    run([RAYDL, "-q", "train", *sets(*common, "train.micro_batch_size=16", "train.global_batch_size=32",
                                     f"data.path={work / 'text'}", f"train.max_steps={args.pretrain_steps}",
                                     f"run.dir={work / 'pre'}")], log, "pre-train")

    def score(run_dir: Path, *extra: str) -> dict:
        return json.loads(run([RAYDL, "generate", str(run_dir), "--eval", str(work / "held.jsonl"),
                               "--max-new-tokens", "8", "--json", *extra], log, f"exact match of {run_dir.name}"))

    def fine_tune(variant: str, name: str) -> list[str]:
        dataset, _, settings = VARIANTS[variant]
        return [RAYDL, "-q", "train", *sets(*common, *settings, f"data.path={work / dataset}",
                                            f"train.init_from={work / 'pre'}", f"train.max_steps={args.finetune_steps}",
                                            f"run.dir={work / name}", f"debug.ledger_dir={work / name}-ledger")]

    before = score(work / "pre", "--tokenizer", str(work / "tok"), "--template", "chat")
    summary = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "seed": args.seed,
               "held_out_records": before["records"], "exact_match_before": before["exact_match"], "variants": {}}
    seen: dict[str, Counter] = {}
    for variant in args.variants:
        run(fine_tune(variant, variant), log, f"fine-tune {variant}")
        after = score(work / variant)
        ran = json.loads((work / variant / "summary.json").read_text())
        records = json.loads((work / VARIANTS[variant][0] / "manifest.json").read_text())["records"]
        seen[variant] = samples_seen(work / f"{variant}-ledger")
        summary["variants"][variant] = {
            "exact_match": after["exact_match"], "ended_with_end_token": after["ended_with_end_token"],
            "fine_tune_wall_s": next(s["wall_s"] for s in log if s["step"] == f"fine-tune {variant}"),
            "train_s": round(ran["wall_s"], 1),
            "rows_trained": sum(seen[variant].values()),
            "records_per_row": round(records["records"] / records["rows"], 2), "final_loss": ran["final_loss"],
            "eval_loss": ran["eval"]["loss"], "examples": after["examples"]}
    if args.kill_worker_at:
        first = args.variants[0]
        killed_at = run_killing_a_worker(fine_tune(first, f"{first}-killed"), work / f"{first}-killed",
                                         args.kill_worker_at, log, f"fine-tune {first}, a worker killed")
        killed = score(work / f"{first}-killed")
        ran = json.loads((work / f"{first}-killed" / "summary.json").read_text())
        summary["worker_killed"] = {
            "variant": first, "after_step": killed_at, "exact_match": killed["exact_match"],
            "exact_match_change_points": round(100 * (killed["exact_match"] - summary["variants"][first]["exact_match"]), 1),
            "same_samples_seen": samples_seen(work / f"{first}-killed-ledger") == seen[first],
            "restarts": len(ran["restarts"]), "member_changes": ran["members"]}
    summary["steps"] = log
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
