"""raydl export of a LoRA run (train.lora on a Hugging Face base): --adapter writes a directory that
peft.PeftModel.from_pretrained loads onto the base, --format hf the merged model; both give raydl's logits to 1e-5.
Export onto base weights that changed since is refused. The checkpoint is saved in this process (one rank) from
a model built as a worker builds it; checkpoints of other layouts: tests/dist/test_lora_resume.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from raydl.cli import main
from raydl.driver import init_from
from raydl.driver.lora_base import lora_fingerprint
from raydl.driver.prepare import claim_run_dir
from raydl.models.choice import choose_model
from raydl.models.lora import is_adapter
from raydl.models.loss import logits_out
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt
from raydl.train.engines import build_engine
from raydl.train.model_build import build_for_worker
from raydl.train.optim import build_optimizer
from tests.unit.test_export import LLAMA, token_batch


def _base_dir(path: Path, overrides: list[str], seed: int) -> Path:
    """A Hugging Face save_pretrained directory of a tiny Llama, the LoRA run's base."""
    cfg = load_config(None, [*overrides, f"train.seed={seed}"])
    choice = choose_model(cfg.model)
    torch.manual_seed(seed)
    choice.build(choice.open_dataset(cfg).meta).causal_lm.save_pretrained(path)
    return path


def _lora_run(run_dir: Path, overrides: list[str]):
    """A LoRA run's directory, as `raydl train` claims it, and one checkpoint of adapters trained away from B = 0;
    returns the adapted model (eval) and the dataset meta."""
    cfg = init_from.as_hf_weights(load_config(None, overrides), "hf")
    choice = choose_model(cfg.model)
    meta = choice.open_dataset(cfg).meta
    model, init = build_for_worker(choice, meta, cfg)
    fingerprint = {**choice.fingerprint(model), **lora_fingerprint(cfg, None)}
    session = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    engine = build_engine(model, cfg, choice.spec, session, meta, init)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if is_adapter(name):
                p.add_(torch.randn_like(p) * 0.1)
    claim_run_dir(run_dir, cfg, reuse_same_config=False, write=True)
    state = {"step": 1, "samples": 8, "position": {"epoch": 0, "offset": 8}, "model": fingerprint,
             "layout": {"world_size": 1}, "scaler": None, "lr": 0.0, "saved_by_ranks": 1}
    ckpt.save(run_dir / "train" / ckpt.checkpoint_name(1), engine.model,
              build_optimizer(engine.parameters(), cfg.train), state, rank=0)
    return engine.model.eval(), meta


@pytest.mark.slow   # imports transformers and peft
def test_adapter_and_merged_exports_give_raydls_logits_and_a_changed_base_is_refused(tmp_path, data_cache, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = [f"data.cache_dir={data_cache}"]
    base = _base_dir(tmp_path / "base", LLAMA + data, seed=1)
    model, meta = _lora_run(tmp_path / "run", ["model.name=hf", *data, f"train.init_from={base}",
                                               "train.lora.rank=4", "train.lora.targets=[q_proj,v_proj]"])
    ids = token_batch(meta)
    assert main(["export", str(tmp_path / "run"), "--adapter", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(base)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter").eval()
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    with torch.no_grad(), logits_out(model):   # the engine's loss set its head to hidden states
        expected = model(ids)
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(ids).logits
        assert float((plain - expected).abs().max()) > 1e-3   # the adapters change the model: the test can fail
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)

    _base_dir(base, LLAMA + data, seed=2)   # the base weights replaced since the run
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--adapter", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "'train.init_from'" in err and "were trained on" in err
    assert not (tmp_path / "again").exists()
