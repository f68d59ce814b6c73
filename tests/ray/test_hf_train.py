"""`raydl train --set model.name=hf` end to end on Ray Train: a tiny Llama at dp x pp = 1 x 2 on a token dataset
of `raydl data prepare` (BPE), then `raydl export --format hf` with the dataset's tokenizer. (A tiny GPT-2 at the
layout the planner chooses, parallel.pp_degree=auto: tests/ray/test_pipeline_train.py's second run.)"""

from __future__ import annotations

import json

import pytest

from raydl.cli import main
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt
from tests.dist.test_hf_parity import assert_export_matches
from tests.helpers import REPO

EXAMPLE = REPO / "examples" / "hf_llama_tiny.yaml"   # the README's example, run as it is


@pytest.mark.slow
def test_hf_llama_trains_at_pp2_on_ray_and_exports(tmp_path, ray_session):
    """The first block of docs/huggingface.md, its commands as printed there (which marks it `tested by` this test)
    on a corpus of its own: `raydl data prepare ... --tokenizer bpe --vocab-size 320 --seq-len 16`, `raydl train
    --config examples/hf_llama_tiny.yaml --set data.path=... --set run.dir=...`, `raydl export RUN --format hf`."""
    from transformers import AutoModelForCausalLM

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"{i} green trains cross {i % 7} rivers at dawn\n" for i in range(600)))
    assert main(["data", "prepare", str(corpus), "--from", "text", "--tokenizer", "bpe", "--vocab-size", "320",
                 "--seq-len", "16", "--out", str(tmp_path / "data" / "corpus"), "--quiet"]) == 0
    run_dir = tmp_path / "runs" / "llama"
    sets = [f"data.path={tmp_path / 'data' / 'corpus'}", f"run.dir={run_dir}", "telemetry.progress=false"]
    assert main(["train", "--config", str(EXAMPLE), *(a for s in sets for a in ("--set", s))]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["final_loss"] < summary["first_loss"] - 0.5, summary
    (layout,) = summary["layouts"]
    assert (layout["dp"], layout["pp"], layout["schedule"]) == (1, 2, "1f1b")

    out = tmp_path / "my_llama"
    assert_export_matches(ckpt.find_latest(run_dir), load_config(run_dir / "config.yaml"), out, source=run_dir)
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "data" / "corpus" / "tokenizer.json").read_bytes()
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 3
