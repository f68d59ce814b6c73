"""raydl data prepare / inspect on small real files made here, and each bad input (exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydl.cli import main as cli
from raydl.data.dataset import check_task, open_dataset
from raydl.data.prepare import prepare
from raydl.data.tokenizer import BYTE_EOS as EOS

WORDS = "the quick brown fox jumps over a lazy dog".split()


def write_texts(d: Path, files: int = 3, words: int = 2000) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(files):
        (d / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS, words)))
    return d


def write_images(d: Path, per_class: int = 20) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        (d / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            a = rng.integers(0, 60, (40, 48, 3), dtype=np.uint8)
            a[8:30, 8:30] = colour
            Image.fromarray(a).save(d / c / f"{i}.png")
    return d


def read_split(root: Path, split: str) -> pa.Table:
    manifest = json.loads((root / "manifest.json").read_text())
    return pa.concat_tables([pq.read_table(root / s["file"]) for s in manifest["splits"][split]["shards"]])


def test_text_rows_are_packed_bytes_with_next_token_labels(tmp_path):
    src = write_texts(tmp_path / "txt")
    m = prepare("text", str(src / "*.txt"), str(tmp_path / "out"), shard_rows=100, seq_len=32, progress=False)
    corpus = b"".join((src / f"doc{i}.txt").read_bytes() + b"\x00" for i in range(3))   # 0 marks EOS here
    tokens = np.frombuffer(corpus, np.uint8).astype(np.int64)
    tokens[tokens == 0] = EOS
    rows = pa.concat_tables([read_split(tmp_path / "out", s) for s in ("train", "eval")]).sort_by("id")
    ids = rows["id"].to_numpy()
    inputs = np.stack(rows["input_ids"].to_numpy(zero_copy_only=False))
    labels = np.stack(rows["labels"].to_numpy(zero_copy_only=False))
    assert list(ids) == list(range(len(ids))) and len(ids) == (len(tokens) - 1) // 32
    assert np.array_equal(inputs.ravel(), tokens[:len(ids) * 32])          # nothing lost between rows
    assert np.array_equal(labels.ravel(), tokens[1:len(ids) * 32 + 1])     # labels = next token
    assert m["splits"]["eval"]["rows"] == len([i for i in ids if i % 16 == 0])
    assert all(s["rows"] <= 100 and len(s["sha256"]) == 64 for s in m["splits"]["train"]["shards"])
    assert m["rows"] == len(ids) and m["schema"]["input_ids"].startswith("fixed_size_list")


def test_bpe_tokenizer_is_trained_saved_and_decodes_the_rows(tmp_path, capsys):
    src = write_texts(tmp_path / "txt", words=4000)
    m = prepare("text", str(src), str(tmp_path / "bpe"), seq_len=16, tokenizer="bpe", vocab_size=300, progress=False)
    assert m["tokenizer"] == "bpe" and 257 < m["vocab_size"] <= 300 and (tmp_path / "bpe" / "tokenizer.json").exists()
    rows = pa.concat_tables([read_split(tmp_path / "bpe", s) for s in ("train", "eval")]).sort_by("id")
    tokens = np.stack(rows["input_ids"].to_numpy(zero_copy_only=False)).ravel()
    assert tokens.max() < 300 and (tokens == m["eos"]).sum() == 3 - 1 + (tokens[-1] == m["eos"])  # EOS per file
    byte_rows = prepare("text", str(src), str(tmp_path / "bytes"), seq_len=16, progress=False)["rows"]
    assert m["rows"] < byte_rows / 2                       # words merged: far fewer tokens than bytes
    assert cli(["data", "inspect", str(tmp_path / "bpe")]) == 0
    out = capsys.readouterr().out
    assert any(w in out for w in WORDS) and "\\u0120" not in out   # decoded text, not byte-level symbols
    # a given tokenizer.json is reused as is
    again = prepare("text", str(src), str(tmp_path / "reuse"), seq_len=16, progress=False,
                    tokenizer=str(tmp_path / "bpe" / "tokenizer.json"))
    assert again["vocab_size"] == m["vocab_size"] and again["rows"] == m["rows"]


def test_jsonl_column_and_images(tmp_path, capsys):
    src = tmp_path / "logs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"record {i} " * 20, "n": i}) for i in range(50)))
    assert cli(["data", "prepare", "--from", "jsonl", str(src), "--out", str(tmp_path / "j"), "--seq-len", "16",
                "--quiet"]) == 0
    info = open_dataset(str(tmp_path / "j"))
    check_task(info, "tokens", "gpt")
    first = read_split(tmp_path / "j", "eval").to_pylist()[0]
    assert bytes(first["input_ids"]) == b"record 0 record "

    write_images(tmp_path / "imgs")
    assert cli(["data", "prepare", "--from", "images", str(tmp_path / "imgs"), "--out", str(tmp_path / "i"),
                "--quiet"]) == 0
    info = open_dataset(str(tmp_path / "i"))
    assert info.meta["classes"] == ["blue", "red"] and info.meta["image_shape"] == [3, 32, 32]
    table = pa.concat_tables([read_split(tmp_path / "i", s) for s in ("train", "eval")])
    images = np.stack(table["image"].to_numpy(zero_copy_only=False)).reshape(-1, 3, 32, 32)
    labels = table["label"].to_numpy()
    assert sorted(table["id"].to_pylist()) == list(range(40))
    assert (images[labels == 1, 0, 10:18, 10:18] > 200).all() and (images[labels == 0, 2, 10:18, 10:18] > 200).all()
    assert 0 < labels[:10].sum() < 10          # shuffled, not one class after the other

    capsys.readouterr()
    assert cli(["data", "inspect", str(tmp_path / "i"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "images data, 40 rows" in out and "checksums: 2 shard(s) match" in out and "class: " in out


def test_inputs_named_literally_by_glob_or_through_a_link(tmp_path):
    """A file name with '[' is that file; an image glob's classes are the folders under its fixed part;
    a linked directory (not a loop) is read like any other."""
    literal = write_texts(tmp_path / "notes[1]", files=1) / "doc0.txt"
    assert prepare("text", str(literal), str(tmp_path / "a"), seq_len=16, progress=False)["rows"] > 0
    write_images(tmp_path / "imgs", per_class=3)
    m = prepare("images", str(tmp_path / "imgs" / "*" / "*.png"), str(tmp_path / "b"), progress=False)
    assert m["classes"] == ["blue", "red"] and m["rows"] == 6
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "linked").symlink_to(tmp_path / "notes[1]")
    write_texts(tmp_path / "mixed" / "own", files=1)
    m = prepare("text", str(tmp_path / "mixed"), str(tmp_path / "c"), seq_len=16, progress=False)
    assert m["source"]["files"] == 2


def test_parquet_passthrough_infers_metadata(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    x = np.random.default_rng(0).integers(0, 500, size=(300, 8))
    for i in range(2):
        pq.write_table(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(x[i::2].ravel()), 8),
                                 "labels": pa.FixedSizeListArray.from_arrays(pa.array(x[i::2].ravel()), 8)}),
                       src / f"p{i}.parquet")
    m = prepare("parquet", str(src), str(tmp_path / "out"), progress=False)
    assert (m["task"], m["vocab_size"], m["seq_len"], m["rows"]) == ("tokens", int(x.max()) + 1, 8, 300)


def expect_error(capsys, argv: list[str], *needles: str) -> str:
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "Fix:" in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_bad_inputs_exit_2_with_the_path_and_the_fix(tmp_path, capsys, tiny_overrides):
    missing, empty = tmp_path / "nope", tmp_path / "empty"
    empty.mkdir()
    expect_error(capsys, ["data", "prepare", "--from", "text", str(missing), "--out", str(tmp_path / "o")],
                 str(missing), "does not exist")
    expect_error(capsys, ["data", "prepare", "--from", "text", str(empty), "--out", str(tmp_path / "o")],
                 str(empty), "empty directory")
    expect_error(capsys, ["data", "inspect", str(missing)], str(missing), "does not exist")
    expect_error(capsys, ["data", "inspect", str(empty)], str(empty), "empty directory")

    junk = tmp_path / "pq"
    junk.mkdir()
    pq.write_table(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(16)), 8)}),
                   junk / "a.parquet")
    (junk / "b.parquet").write_text("not parquet at all")
    expect_error(capsys, ["data", "prepare", "--from", "parquet", str(junk), "--out", str(tmp_path / "o")],
                 str(junk / "b.parquet"), "not a parquet file")
    expect_error(capsys, ["data", "inspect", str(junk / "b.parquet")], str(junk / "b.parquet"), "not parquet")

    (junk / "b.parquet").unlink()
    pq.write_table(pa.table({"input_ids": pa.array([1, 2])}), junk / "b.parquet")
    expect_error(capsys, ["data", "prepare", "--from", "parquet", str(junk), "--out", str(tmp_path / "o")],
                 str(junk / "a.parquet"), str(junk / "b.parquet"), "different schemas")

    # a tokens dataset without labels, and an images dataset, given to gpt: caught before training starts
    (junk / "b.parquet").unlink()
    prepare("parquet", str(junk), str(tmp_path / "nolabels"), progress=False)
    expect_error(capsys, ["train", *(f"--set={o}" for o in tiny_overrides), f"--set=data.path={tmp_path / 'nolabels'}"],
                 str(tmp_path / "nolabels"), "'labels'", "model 'gpt' needs")
    write_images(tmp_path / "imgs", per_class=3)
    prepare("images", str(tmp_path / "imgs"), str(tmp_path / "img"), progress=False)
    expect_error(capsys, ["train", *(f"--set={o}" for o in tiny_overrides), f"--set=data.path={tmp_path / 'img'}"],
                 str(tmp_path / "img"), "'images' data but model 'gpt'")

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    expect_error(capsys, ["data", "prepare", "--from", "jsonl", str(bad_json), "--out", str(tmp_path / "o")],
                 f"'{bad_json}' line 2", "--column")
    texts = write_texts(tmp_path / "txt", files=1, words=50)
    expect_error(capsys, ["data", "prepare", "--from", "text", str(texts), "--out", str(tmp_path / "o"),
                          "--tokenizer", str(tmp_path / "gpt2.json")], str(tmp_path / "gpt2.json"), "tokenizer.json")
    expect_error(capsys, ["data", "prepare", "--from", "text", str(texts), "--out", str(tmp_path / "o"),
                          "--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size 100")
    assert not (tmp_path / "o").exists()        # a failed prepare leaves nothing behind
