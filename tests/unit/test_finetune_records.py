"""raydl data prepare --format (records with loss masks) on a real local tokenizer directory made here
(tests/chat_tokenizer.py: a BPE with a ChatML template, nothing downloaded), and each bad record (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydl.cli import main as cli
from raydl.data.dataset import open_dataset
from raydl.data.hf_tokenizer import load_tokenizer_dir
from raydl.data.loader import to_tensors
from raydl.data.prepare import prepare
from raydl.data.prepare_records import RecordFormat
from raydl.models.gpt import tokens
from tests.chat_tokenizer import make_tokenizer_dir

CHAT = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is two plus three?"},
                     {"role": "assistant", "content": "five"},
                     {"role": "user", "content": "And three plus four?"},
                     {"role": "assistant", "content": "seven"}]}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rows(root: Path) -> list[dict]:
    manifest = json.loads((root / "manifest.json").read_text())
    tables = [pq.read_table(root / s["file"]) for split in ("train", "eval") for s in manifest["splits"][split]["shards"]]
    return sorted(pa.concat_tables(tables).to_pylist(), key=lambda r: r["id"])


def prep(tmp_path, tok_dir, records, name="out", **fmt) -> tuple[Path, dict]:
    src = write_jsonl(tmp_path / f"{name}.jsonl", records)
    fmt = {"format": "chat", "seq_len": 64, **fmt}
    manifest = prepare("jsonl", str(src), str(tmp_path / name), tokenizer=str(tok_dir), records=RecordFormat(**fmt),
                       progress=False)
    return tmp_path / name, manifest


def learnt(tok, row) -> list[str]:
    """The text of each run of consecutive learnt labels."""
    runs, current = [], []
    for label in row["labels"] + [-100]:
        if label == -100 and current:
            runs.append(tok.decode(current))
            current = []
        elif label != -100:
            current.append(label)
    return runs


@pytest.mark.parametrize("train_on, expected", [
    ("assistant", ["five<|im_end|>\n", "seven<|im_end|>\n"]),
    ("last", ["seven<|im_end|>\n"]),
])
def test_chat_labels_are_the_assistant_turns_with_their_end_of_turn_token(tmp_path, tok_dir, train_on, expected):
    tok = load_tokenizer_dir(tok_dir)
    root, manifest = prep(tmp_path, tok_dir, [CHAT] * 17, train_on=train_on)
    row = rows(root)[0]
    assert learnt(tok, row) == expected
    full = tok(tok.apply_chat_template(CHAT["messages"], tokenize=False), add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == full[:-1]                      # one record, one row, next-token labels
    assert all(label in (-100, t) for label, t in zip(row["labels"], full[1:]))
    # what a user will send later (add_generation_prompt) is exactly the row's first tokens
    prompt = tok.apply_chat_template(CHAT["messages"][:4], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert row["input_ids"][:len(prompt_ids)] == prompt_ids
    assert manifest["records"]["records"] == 17 and manifest["eos"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert (root / "tokenizer" / "tokenizer_config.json").is_file()


def test_train_on_all_learns_every_token_but_the_first(tmp_path, tok_dir):
    root, _ = prep(tmp_path, tok_dir, [CHAT] * 17, train_on="all")
    row = rows(root)[0]
    assert row["labels"] == row["input_ids"][1:] + [row["labels"][-1]]


def test_alpaca_and_sharegpt_records_are_recognised(tmp_path, tok_dir):
    tok = load_tokenizer_dir(tok_dir)
    alpaca = {"instruction": "Add the numbers.", "input": "two and three", "output": "five"}
    root, _ = prep(tmp_path, tok_dir, [alpaca] * 17, name="alpaca", format="prompt-response")
    row = rows(root)[0]
    prompt = tok("Add the numbers.\n\ntwo and three", add_special_tokens=False)["input_ids"]
    assert row["input_ids"][:len(prompt)] == prompt
    assert learnt(tok, row) == ["five<|im_end|>"]
    sharegpt = {"conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "I am fine."}]}
    root, _ = prep(tmp_path, tok_dir, [sharegpt] * 17, name="sharegpt")
    assert learnt(tok, rows(root)[0]) == ["I am fine.<|im_end|>\n"]


def test_overflow_is_truncated_dropped_or_refused_and_counted(tmp_path, tok_dir, capsys):
    short = {"prompt": "one plus two", "response": "three"}
    long = {"prompt": "one plus two " * 20, "response": "three"}
    records = [short, long, long] * 10
    root, manifest = prep(tmp_path, tok_dir, records, name="drop", format="prompt-response", overflow="drop",
                          seq_len=16)
    assert (manifest["records"]["records"], manifest["records"]["dropped"]) == (30, 20) and manifest["rows"] == 10
    _, manifest = prep(tmp_path, tok_dir, [{"prompt": "one", "response": "two three " * 20}] * 20, name="cut",
                       format="prompt-response", seq_len=16)
    assert manifest["records"]["truncated"] == 20 and manifest["records"]["dropped"] == 0
    assert max(len(r["input_ids"]) for r in rows(tmp_path / "cut")) == 16
    src = write_jsonl(tmp_path / "err.jsonl", records)
    code = cli(["data", "prepare", str(src), "--from", "jsonl", "--format", "prompt-response", "--tokenizer",
                str(tok_dir), "--seq-len", "16", "--overflow", "error", "--out", str(tmp_path / "err")])
    assert code == 2 and "line 2" in capsys.readouterr().err and not (tmp_path / "err").exists()


@pytest.mark.parametrize("record, template, words", [
    ({"prompt": "two plus three", "response": ""}, True, "field 'response' is empty"),
    ({"messages": [{"role": "user", "content": "hi"}]}, True, "no assistant turn"),
    ({"question": "two plus three"}, True, "--prompt-field"),
    (CHAT, False, "has none (no chat_template"),
])
def test_a_record_without_a_target_or_a_chat_without_template_exits_2_writing_nothing(tmp_path, record, template,
                                                                                     words, capsys):
    tok = make_tokenizer_dir(tmp_path / "tok", **({} if template else {"template": None}))
    fmt = "chat" if "messages" in record else "prompt-response"
    src = write_jsonl(tmp_path / "in.jsonl", [CHAT if fmt == "chat" else {"prompt": "a", "response": "b"}] * 3 + [record])
    code = cli(["data", "prepare", str(src), "--from", "jsonl", "--format", fmt, "--tokenizer", str(tok),
                "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_template_whose_prompt_is_no_prefix_of_its_rendering_is_refused(tmp_path, capsys):
    # renders the last message apart from the others: the generation prompt then differs from training's
    odd = ("{% for m in messages %}{% if loop.last %}[final]{% endif %}<|im_start|>{{ m['role'] }}\n"
           "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = make_tokenizer_dir(tmp_path / "tok", template=odd)
    src = write_jsonl(tmp_path / "in.jsonl", [CHAT])
    code = cli(["data", "prepare", str(src), "--from", "jsonl", "--format", "chat", "--tokenizer", str(tok),
                "--out", str(tmp_path / "out")])
    assert code == 2 and "add_generation_prompt=True" in capsys.readouterr().err


def test_batches_are_padded_with_a_mask_and_padding_learns_nothing(tmp_path, tok_dir):
    records = [{"prompt": "one", "response": "two"}, {"prompt": "one plus two plus three", "response": "six"}] * 9
    root, _ = prep(tmp_path, tok_dir, records, format="prompt-response")
    table = pa.concat_tables([pq.read_table(p) for p in sorted(root.glob("train-*.parquet"))]).slice(0, 2)
    meta = open_dataset(str(root)).meta
    batch = to_tensors(table, meta)
    inputs, labels = tokens(batch)
    lengths = batch["input_ids_mask"].sum(1)
    # every batch padded to the dataset's seq_len: the same shapes at every step (pipeline stages, compiled blocks)
    assert inputs.shape[1] == meta["seq_len"] > int(lengths.max()) > int(lengths.min())
    short = int(lengths.argmin())
    assert (labels[short, int(lengths[short]):] == -100).all()
    assert labels[short, int(lengths[short]) - 1] == load_tokenizer_dir(tok_dir).eos_token_id


def test_inspect_tokens_shows_each_token_beside_its_label(tmp_path, tok_dir, capsys):
    root, _ = prep(tmp_path, tok_dir, [CHAT] * 17)
    assert cli(["data", "inspect", str(root), "--tokens", "40"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "->" in line and "<|im_start|>" in line]
    assert lines and all(line.rstrip().endswith("-") for line in lines)     # the turn markers are not learnt
    learnt_labels = [line.split("->")[1].strip() for line in out.splitlines() if "->" in line]
    assert "".join(label.split(" ", 1)[1] for label in learnt_labels if label != "-").startswith("five<|im_end|>")


def test_a_padded_hf_vocabulary_is_accepted_and_another_refused(tmp_path, tok_dir):
    from raydl.errors import ConfigError
    from raydl.models.hf.config import _check_dataset_agrees

    class Config:
        vocab_size, max_position_embeddings = 512, 64

    _check_dataset_agrees(Config, {"vocab_size": 388, "seq_len": 64, "tokenizer": "hf"}, "weights")
    with pytest.raises(ConfigError, match="vocabulary of 512"):
        _check_dataset_agrees(Config, {"vocab_size": 388, "seq_len": 64, "tokenizer": "bpe"}, "weights")
    Config.vocab_size = 300
    with pytest.raises(ConfigError, match="vocabulary of 300"):
        _check_dataset_agrees(Config, {"vocab_size": 388, "seq_len": 64, "tokenizer": "hf"}, "weights")


def scripted(tok, answer: str):
    """Logits that say `answer` and then the end-of-turn token, whatever the prompt: drives the decoding loop."""
    script = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    state = {"prompt": None}

    def logits(ids):
        if state["prompt"] is None:
            state["prompt"] = ids.shape[1]
        out = torch.zeros(1, ids.shape[1], len(tok))
        out[0, -1, script[min(ids.shape[1] - state["prompt"], len(script) - 1)]] = 1.0
        return out
    return logits


def test_generation_encodes_the_prompt_as_training_did_and_stops_at_the_end_of_turn(tmp_path, tok_dir):
    from raydl.generate import Generator, exact_match

    tok = load_tokenizer_dir(tok_dir)
    root, _ = prep(tmp_path, tok_dir, [CHAT] * 17, train_on="last")
    row = rows(root)[0]
    def generator():    # a fresh script per answer
        return Generator(scripted(tok, "seven"), tok, chat=True, end=tok.eos_token_id, max_positions=64)

    prompt = generator().encode(CHAT["messages"][:4])
    assert row["input_ids"][:len(prompt)] == prompt and row["labels"][len(prompt) - 1] != -100
    answer = generator().answer(CHAT["messages"][:4])
    assert (answer.text, answer.ended) == ("seven", True)
    assert not generator().answer("hi", max_new_tokens=1).ended     # cut by the limit, not ended
    write_jsonl(tmp_path / "held.jsonl", [CHAT])
    assert exact_match(generator(), str(tmp_path / "held.jsonl"), max_new_tokens=8)["exact_match"] == 1.0
    write_jsonl(tmp_path / "held.jsonl", [{**CHAT, "messages": CHAT["messages"][:4] + [
        {"role": "assistant", "content": "eight"}]}])
    scored = exact_match(generator(), str(tmp_path / "held.jsonl"), max_new_tokens=8)
    assert (scored["records"], scored["exact_match"], scored["ended_with_end_token"]) == (1, 0.0, 1.0)
