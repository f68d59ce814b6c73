"""Fine-tuning end to end under torchrun (no Ray): pre-train a tiny Hugging Face Llama on text with a local
tokenizer directory (tests/chat_tokenizer.py), start a new run on chat records from its weights (train.init_from)
at another layout (pp=2 over 2 gloo ranks instead of one process), then answer with `raydl generate` from the run
and from its export."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from raydl.cli import main as cli
from raydl.export.trained import find_trained
from raydl.train import checkpoint as ckpt
from tests.chat_tokenizer import SAMPLE_TEXT, make_tokenizer_dir
from tests.helpers import torchrun_worker

MODEL = ["model.name=hf", "model.options.family=llama", "model.options.layers=2", "model.options.hidden_size=32",
         "model.options.kv_heads=2", "train.global_batch_size=8", "train.micro_batch_size=2",
         "telemetry.progress=false", "train.eval_batches=1"]


def records(n: int) -> str:
    words = "one two three four five six seven eight nine ten".split()
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"What is {words[i % 10]} plus one?"},
                                            {"role": "assistant", "content": words[(i + 1) % 10]}]}) + "\n"
                   for i in range(n))


def weights(run) -> dict[str, torch.Tensor]:
    trained = find_trained(str(run))
    model = trained.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.load_weights(trained.checkpoint, model)
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_new_run_starts_from_trained_weights_at_another_layout_and_answers(tmp_path, capsys):
    tok = make_tokenizer_dir(tmp_path / "tok")
    (tmp_path / "corpus.txt").write_text((SAMPLE_TEXT + "\n") * 100)
    (tmp_path / "chat.jsonl").write_text(records(48))
    assert cli(["-q", "data", "prepare", str(tmp_path / "corpus.txt"), "--from", "text", "--tokenizer",
                str(tok / "tokenizer.json"), "--seq-len", "32", "--out", str(tmp_path / "text")]) == 0
    assert cli(["-q", "data", "prepare", str(tmp_path / "chat.jsonl"), "--from", "jsonl", "--format", "chat",
                "--tokenizer", str(tok), "--seq-len", "32", "--out", str(tmp_path / "chat")]) == 0
    pre = torchrun_worker(1, tmp_path / "pre", [*MODEL, f"data.path={tmp_path / 'text'}", "train.max_steps=3"],
                          timeout_s=240)
    assert pre.returncode == 0, pre.stderr[-3000:]
    # lr 1e-30 (0 is refused) moves no fp32 weight: the new run keeps the weights it started from
    fine = torchrun_worker(2, tmp_path / "fine", [*MODEL, f"data.path={tmp_path / 'chat'}", "train.max_steps=1",
                                                  "train.lr=1e-30", "parallel.pp_degree=2",
                                                  f"train.init_from={tmp_path / 'pre'}"], timeout_s=300)
    assert fine.returncode == 0, fine.stderr[-3000:]
    summary = json.loads((tmp_path / "fine" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["eval"]["perplexity"] == pytest.approx(
        torch.tensor(summary["eval"]["loss"]).exp().item(), rel=1e-6)
    before, after = weights(tmp_path / "pre"), weights(tmp_path / "fine")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    capsys.readouterr()
    (tmp_path / "held.jsonl").write_text(records(3))
    assert cli(["generate", str(tmp_path / "fine"), "--eval", str(tmp_path / "held.jsonl"), "--json",
                "--max-new-tokens", "4"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["records"] == 3 and 0 <= scored["exact_match"] <= 1
    assert cli(["-q", "export", str(tmp_path / "fine"), "--format", "hf", "--out", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "tokenizer_config.json").is_file()
    capsys.readouterr()
    answers = []
    for source in (tmp_path / "fine", tmp_path / "export"):
        assert cli(["generate", str(source), "--prompt", "What is two plus one?", "--max-new-tokens", "6",
                    "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert answers[0] == answers[1] and answers[0]["tokens"] > 0   # the same greedy tokens from run and export
