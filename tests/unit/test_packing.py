"""Clean packing (raydl data prepare --pack): a packed row gives each record the loss and gradients it gets alone
(raydl's gpt and the Hugging Face Llama, GPT-2 and sliding-window Mistral blocks, fp32, to 1e-5), the packer fills
>= 95% of the slots on log-normal lengths, prepare writes document ids with no label across a record boundary, and
bad input exits 2."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from raydl.cli import main as cli
from raydl.data.dataset import open_dataset
from raydl.data.loader import to_tensors
from raydl.data.packing import pack_lengths
from raydl.errors import DataError
from raydl.models import gpt
from raydl.models.choice import ModelChoice
from raydl.models.packing import document_positions, packed_kwargs
from tests.unit.test_finetune_records import prep, rows, tok_dir, write_jsonl  # noqa: F401  (tok_dir: a fixture)

VOCAB, SEQ = 53, 32
LENGTHS = (11, 4, 9, 1, 5)   # records of a packed row; 2 slots of padding after them


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return gpt.gpt_blocks(2, 32, 4, vocab_size=VOCAB, seq_len=SEQ, dropout=0.0)
    from raydl.models.hf.model import build
    from raydl.models.hf.options import HfOptions

    family, attention = kind.split("-")
    options = HfOptions(family=family, hidden_size=32, num_attention_heads=4, attention=attention,
                        num_key_value_heads=2 if family != "gpt2" else 0,
                        sliding_window=4 if family == "mistral" else 0)   # shorter than the longer records
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # GPT-2's untie warning
        return build(options, {"vocab_size": VOCAB, "seq_len": SEQ})


def _records() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) per record: labels are the next tokens, the first two of each record unlearnt."""
    g = torch.Generator().manual_seed(3)
    out = []
    for length in LENGTHS:
        tokens = torch.randint(0, VOCAB, (length + 1,), generator=g)
        labels = tokens[1:].clone()
        labels[:2] = -100
        out.append((tokens[:-1], labels))
    return out


def _loss_and_grads(model, ids, labels, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    losses = torch.nn.functional.cross_entropy(model(ids, **kwargs).flatten(0, 1), labels.flatten(),
                                               ignore_index=-100, reduction="none")
    losses.sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["gpt", "llama-sdpa", "llama-eager", "gpt2-sdpa", "mistral-sdpa"])
def test_a_packed_row_gives_each_record_its_own_loss_and_gradients(kind):
    model = _model(kind).float()
    records = _records()
    width = sum(LENGTHS) + 2
    ids = torch.zeros(1, width, dtype=torch.long)
    documents = torch.full((1, width), -1)     # the padding: a document of its own (packed_kwargs)
    start = 0
    for d, (record_ids, _) in enumerate(records):
        ids[0, start:start + len(record_ids)] = record_ids
        documents[0, start:start + len(record_ids)] = d
        start += len(record_ids)
    start = 0
    for d, (record_ids, record_labels) in enumerate(records):
        alone_losses, alone_grads = _loss_and_grads(model, record_ids[None], record_labels[None])
        labels = torch.full((1, width), -100)     # only this record's targets: its own gradient
        labels[0, start:start + len(record_ids)] = record_labels
        packed_losses, packed_grads = _loss_and_grads(model, ids, labels, documents=documents)
        span = packed_losses[start:start + len(record_ids)]
        torch.testing.assert_close(span, alone_losses, rtol=0, atol=1e-5)
        assert packed_losses.count_nonzero() == (record_labels != -100).sum()     # nothing else learnt
        assert set(packed_grads) == set(alone_grads)
        for name, grad in alone_grads.items():
            torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=1e-5, msg=f"{kind} record {d} {name}")
        start += len(record_ids)
    # Without the documents the same row is one sequence: later records see earlier ones, and the losses differ.
    labels = torch.cat([l for _, l in records] + [torch.full((2,), -100)])[None]
    unmasked, _ = _loss_and_grads(model, ids, labels)
    masked, _ = _loss_and_grads(model, ids, labels, documents=documents)
    assert (unmasked - masked).abs().max() > 1e-3


def test_positions_restart_at_every_record_and_padding_is_a_document_of_its_own():
    batch = {"document_ids": torch.tensor([[0, 0, 0, 1, 2, 2, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]]),
             "document_ids_mask": torch.tensor([[True] * 6 + [False] * 2, [True] * 5 + [False] * 3])}
    documents = packed_kwargs(batch)["documents"]
    assert documents.tolist() == [[0, 0, 0, 1, 2, 2, -1, -1], [0, 1, 1, 1, 1, -1, -1, -1]]
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 0, 1, 0, 1], [0, 0, 1, 2, 3, 0, 1, 2]]
    assert packed_kwargs({"input_ids": torch.zeros(1, 3)}) == {}


def test_best_fit_decreasing_fills_95_percent_of_2048_token_rows_on_log_normal_records():
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(200), 1.0, 5000).round(), 20, 2048).astype(int)
    rows_ = pack_lengths(lengths.tolist(), 2048)
    assert sorted(i for row in rows_ for i in row) == list(range(5000))     # every record once
    assert max(lengths[row].sum() for row in rows_) <= 2048
    fill = lengths.sum() / (len(rows_) * 2048)
    assert fill >= 0.95, fill
    # one record per row, padded to 2048, would fill about a sixth
    assert lengths.sum() / (len(lengths) * 2048) < 0.2


def test_prepare_pack_writes_document_ids_and_no_label_crosses_a_record(tmp_path, tok_dir, capsys):
    records = [{"prompt": f"Say {'la ' * (n % 7)}", "response": "la " * (n % 5 + 1)} for n in range(40)]
    plain_root, plain = prep(tmp_path, tok_dir, records, name="plain", format="prompt-response")
    root, manifest = prep(tmp_path, tok_dir, records, name="packed", format="prompt-response", pack=True)
    assert manifest["records"]["packed"] and not plain["records"]["packed"]
    assert manifest["records"]["dropped"] == plain["records"]["dropped"] == 0
    assert manifest["records"]["rows"] < plain["records"]["rows"] == 40
    assert manifest["records"]["fill"] > 0.7 > plain["records"]["fill"]
    alone = sorted((r["input_ids"], r["labels"]) for r in rows(plain_root))
    packed = []
    for row in rows(root):
        documents = np.array(row["document_ids"])
        assert len(row["input_ids"]) == len(row["labels"]) == len(documents) <= 64
        for d in np.unique(documents):       # each record's (input, label) pairs as it has them alone
            span = documents == d
            assert np.ptp(np.flatnonzero(span)) == span.sum() - 1       # contiguous
            packed.append((np.array(row["input_ids"])[span].tolist(), np.array(row["labels"])[span].tolist()))
    assert sorted(packed) == alone
    assert cli(["data", "inspect", str(root), "--tokens", "64"]) == 0
    assert "--- record 1 of the packed row ---" in capsys.readouterr().out
    batch = to_tensors(pq_rows(root), manifest)
    assert batch["document_ids"].shape == batch["input_ids"].shape == (manifest["splits"]["train"]["rows"], 64)
    ModelChoice(gpt.spec, None, "tiny").check_data(open_dataset(str(root)))
    own = dataclasses.replace(gpt.spec, name="own", forward_kwargs=None)   # a model that cannot mask per record
    with pytest.raises(DataError, match="packed rows.*forward_kwargs"):
        ModelChoice(own, None, "tiny").check_data(open_dataset(str(root)))


def pq_rows(root: Path):
    import pyarrow.parquet as pq

    manifest = json.loads((root / "manifest.json").read_text())
    return pq.read_table(root / manifest["splits"]["train"]["shards"][0]["file"])


def test_pack_follows_overflow_and_refuses_input_without_records(tmp_path, tok_dir, capsys):
    long = {"prompt": "la " * 80, "response": "la"}
    src = write_jsonl(tmp_path / "r.jsonl", [long] + [{"prompt": "x", "response": "la"}] * 20)
    common = ["data", "prepare", str(src), "--from", "jsonl", "--format", "prompt-response", "--tokenizer",
              str(tok_dir), "--seq-len", "32", "--pack", "--quiet"]
    assert cli([*common, "--out", str(tmp_path / "err"), "--overflow", "error"]) == 2
    assert "line 1" in capsys.readouterr().err and not (tmp_path / "err").exists()
    assert cli([*common, "--out", str(tmp_path / "trunc")]) == 0
    manifest = json.loads((tmp_path / "trunc" / "manifest.json").read_text())
    assert manifest["records"]["truncated"] == 1 and manifest["records"]["packed"]
    assert max(len(r["input_ids"]) for r in rows(tmp_path / "trunc")) <= 32
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    assert cli(["data", "prepare", str(text), "--from", "jsonl", "--out", str(tmp_path / "t"), "--pack"]) == 2
    err = capsys.readouterr().err
    assert "--pack" in err and "Fix:" in err and "Traceback" not in err and not (tmp_path / "t").exists()


def test_records_are_packed_unless_no_pack_is_given(tmp_path, tok_dir):
    src = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "x", "response": "la"}] * 20)
    common = ["data", "prepare", str(src), "--from", "jsonl", "--format", "prompt-response", "--tokenizer",
              str(tok_dir), "--seq-len", "32", "--quiet"]
    assert cli([*common, "--out", str(tmp_path / "default")]) == 0
    assert cli([*common, "--no-pack", "--out", str(tmp_path / "one")]) == 0
    default, one = (json.loads((tmp_path / d / "manifest.json").read_text())["records"] for d in ("default", "one"))
    assert default["packed"] and default["rows"] < 20
    assert not one["packed"] and one["rows"] == 20
    assert default["target_tokens"] == one["target_tokens"]
