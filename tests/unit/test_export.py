"""raydl export: a checkpoint on disk -> save_pretrained output that transformers loads, or a torch.export
program, each giving raydl's logits to 1e-5; bad input exits 2 and writes nothing.

The checkpoints here are saved in this process (one rank) from a run directory raydl's own
preparation claimed; checkpoints of other layouts: tests/dist/test_hf_parity.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raydl.cli import main
from raydl.driver.prepare import claim_run_dir
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt
from raydl.train.optim import build_optimizer

LLAMA = ["model.name=hf", "model.options.family=llama", "model.options.hidden_size=32", "model.options.kv_heads=2"]
GPT2 = ["model.name=hf", "model.options.family=gpt2", "model.options.hidden_size=32"]


def save_run(run_dir: Path, overrides: list[str]):
    """A run directory with its config.yaml and one checkpoint of weights unlike the seed's init; returns the
    raydl model holding those weights (eval mode) and the dataset meta."""
    cfg = load_config(None, overrides)
    choice = choose_model(cfg.model)
    meta = choice.open_dataset(cfg).meta
    torch.manual_seed(cfg.train.seed)
    model = choice.build(meta)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    claim_run_dir(run_dir, cfg, reuse_same_config=False, write=True)
    state = {"step": 1, "samples": 8, "position": {"epoch": 0, "offset": 8}, "model": choice.fingerprint(model),
             "layout": {"world_size": 1}, "scaler": None, "lr": 0.0, "saved_by_ranks": 1}
    ckpt.save(run_dir / "train" / ckpt.checkpoint_name(1), model, build_optimizer(model.parameters(), cfg.train),
              state, rank=0)
    return model.eval(), meta


def token_batch(meta, rows: int = 3) -> torch.Tensor:
    return torch.randint(0, meta["vocab_size"], (rows, meta["seq_len"]), generator=torch.Generator().manual_seed(5))


@pytest.fixture
def data_sets(data_cache):
    return [f"data.cache_dir={data_cache}"]


@pytest.mark.slow   # imports transformers
def test_hf_export_loads_in_transformers_with_raydl_logits(tmp_path, data_sets):
    from transformers import AutoModelForCausalLM

    model, meta = save_run(tmp_path / "run", LLAMA + data_sets)
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ids = token_batch(meta)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids), rtol=0, atol=1e-5)
    assert not list(tmp_path.glob(".hf.partial-*"))


def test_a_large_model_streams_into_shards_checked_from_their_headers(tmp_path, data_sets, monkeypatch):
    """Shrunk limits stand for a large model: one shard in memory at a time, no whole model to compare logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from raydl.export import hf as hf_export, hf_shards

    monkeypatch.setattr(hf_shards, "MAX_SHARD_BYTES", 8 * 2**10)
    monkeypatch.setattr(hf_export, "CHECK_BYTES", 0)
    monkeypatch.setattr(hf_export.HfExport, "_check_logits", None)   # must not be called
    model, meta = save_run(tmp_path / "run", LLAMA + data_sets)
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and index["metadata"]["total_size"] == sum(4 * p.numel() for p in model.parameters())
    for name in files:
        with safe_open(str(tmp_path / "hf" / name), framework="pt") as f:
            # one shard's bytes are about the limit, or one larger tensor alone
            keys = list(f.keys())
            assert len(keys) == 1 or sum(f.get_tensor(k).numel() * 4
                                         for k in keys) <= 8 * 2**10
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ids = token_batch(meta)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids), rtol=0, atol=1e-5)


def test_gpt2_exports_untied_and_keeps_both_trained_matrices(tmp_path, data_sets):
    from transformers import AutoModelForCausalLM

    with pytest.warns(UserWarning, match="ties lm_head.weight"):
        model, meta = save_run(tmp_path / "run", GPT2 + data_sets)
    checkpoint = tmp_path / "run" / "train" / ckpt.checkpoint_name(1)
    assert main(["export", str(checkpoint), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert loaded.lm_head.weight is not loaded.transformer.wte.weight
    torch.testing.assert_close(loaded.lm_head.weight, model.blocks["head"].lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(loaded.transformer.wte.weight, model.blocks["embed"].wte.weight, rtol=0, atol=0)
    ids = token_batch(meta)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids), rtol=0, atol=1e-5)


def test_the_datasets_tokenizer_goes_with_the_model(tmp_path):
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a small corpus about trains and rivers\n" for i in range(400)))
    assert main(["data", "prepare", str(corpus), "--from", "text", "--out", str(tmp_path / "data"), "--tokenizer",
                 "bpe", "--vocab-size", "300", "--seq-len", "16", "--quiet"]) == 0
    save_run(tmp_path / "run", LLAMA + [f"data.path={tmp_path / 'data'}"])
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "data" / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    from tokenizers import Tokenizer

    original = Tokenizer.from_file(str(tmp_path / "data" / "tokenizer.json"))
    assert tokenizer("trains and rivers").input_ids == original.encode("trains and rivers").ids
    assert tokenizer.eos_token_id == json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"]


def export_pt2(tmp_path, data_sets):
    model, meta = save_run(tmp_path / "run", ["model.name=gpt"] + data_sets)
    assert main(["export", str(tmp_path / "run"), "--format", "pt2", "--out", str(tmp_path / "pt2")]) == 0
    return model, meta


@pytest.mark.slow   # torch.export traces the model (~4 s here)
def test_pt2_export_of_raydls_gpt_gives_its_outputs(tmp_path, data_sets):
    model, meta = export_pt2(tmp_path, data_sets)
    program = torch.export.load(tmp_path / "pt2" / "model.pt2").module()
    for rows, length in ((3, meta["seq_len"]), (1, meta["seq_len"] - 3)):   # the batch and the length are free
        ids = token_batch(meta, rows)[:, :length]
        with torch.no_grad():
            torch.testing.assert_close(program(ids), model(ids), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_pt2_export_loads_in_a_python_without_raydl(tmp_path, data_sets):
    _, meta = export_pt2(tmp_path, data_sets)
    script = (f"import sys, torch; p = torch.export.load({str(tmp_path / 'pt2' / 'model.pt2')!r}).module(); "
              f"print(tuple(p(torch.zeros(2, {meta['seq_len']}, dtype=torch.long)).shape)); "
              f"assert not any(m.startswith('raydl') for m in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str((2, meta["seq_len"], meta["vocab_size"]))


def assert_refused(capsys, argv: list[str], out: Path, *words: str) -> None:
    before = sorted(out.parent.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydl: error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert sorted(out.parent.iterdir()) == before   # nothing written, no partial copy left


def test_bad_input_exits_2_and_writes_nothing(tmp_path, data_sets, capsys):
    save_run(tmp_path / "gpt", ["model.name=gpt"] + data_sets)
    out = tmp_path / "out"
    export = ["export", "--out", str(out), "--format"]
    assert_refused(capsys, export + ["hf", str(tmp_path / "missing")], out, "does not exist")
    (tmp_path / "empty").mkdir()
    assert_refused(capsys, export + ["hf", str(tmp_path / "empty")], out, "holds no usable raydl checkpoint")
    assert_refused(capsys, export + ["hf", str(tmp_path / "gpt")], out, "--format", "model 'gpt'", "pt2")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_refused(capsys, export + ["pt2", str(tmp_path / "gpt")], out, "--out", "not an empty directory")
    assert (out / "keep.txt").read_text() == "mine"


def test_a_checkpoint_outside_its_run_needs_the_runs_config(tmp_path, data_sets, capsys):
    save_run(tmp_path / "run", LLAMA + data_sets)
    moved = tmp_path / "elsewhere" / "deep" / "ck"
    moved.parent.mkdir(parents=True)
    (tmp_path / "run" / "train" / ckpt.checkpoint_name(1)).rename(moved)
    out = tmp_path / "out"
    assert_refused(capsys, ["export", str(moved), "--format", "hf", "--out", str(out)], out, "config.yaml", "--config")
    assert main(["export", str(moved), "--format", "hf", "--out", str(out), "--config",
                 str(tmp_path / "run" / "config.yaml")]) == 0
    assert (out / "model.safetensors").is_file()


def test_a_damaged_checkpoint_is_a_checkpoint_error(tmp_path, data_sets, capsys):
    save_run(tmp_path / "run", ["model.name=gpt"] + data_sets)
    checkpoint = tmp_path / "run" / "train" / ckpt.checkpoint_name(1)
    shard = next(checkpoint.glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    out = tmp_path / "out"
    assert_refused(capsys, ["export", str(checkpoint), "--format", "pt2", "--out", str(out)], out, "not usable",
             "checksum")
