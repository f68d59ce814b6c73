"""train.init_from on real checkpoints written here (DCP, one process): the weights and nothing else load, and a
model or a vocabulary that does not fit is refused on the driver naming the field."""

from __future__ import annotations

import warnings

import pytest
import torch

from raydl.driver import init_from
from raydl.errors import ConfigError
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt

META = {"task": "tokens", "vocab_size": 40, "seq_len": 8}


def build(cfg, meta, seed):
    torch.manual_seed(seed)
    return choose_model(cfg.model).build(meta)


def save_run(tmp_path, meta=META, sets=()) -> tuple:
    cfg = load_config(None, ["model.name=gpt", *sets])
    model = build(cfg, meta, seed=1)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    optimizer.step()     # an optimizer state that init_from must not read
    state = {"step": 5, "samples": 40, "position": {"epoch": 0, "offset": 40}, "model": {"name": "gpt"},
             "layout": {"world_size": 1}, "scaler": None, "lr": 0.001, "saved_by_ranks": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # DCP without a process group: intended
        ckpt.save(tmp_path / "run" / "train" / "step_00000005", model, optimizer, state, rank=0)
    return cfg, model


@pytest.mark.slow   # DCP save and load: seconds each
def test_the_weights_load_into_a_new_model_and_nothing_else(tmp_path):
    cfg, saved = save_run(tmp_path)
    cfg = load_config(None, ["model.name=gpt", f"train.init_from={tmp_path / 'run'}"])
    fresh = build(cfg, META, seed=2)
    assert any(not torch.equal(a, b) for a, b in zip(fresh.parameters(), saved.parameters()))
    found = init_from.resolve(cfg, fresh, META)
    assert found.endswith("step_00000005")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.load_weights(found, fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), saved.state_dict().values()))


@pytest.mark.slow   # DCP save and load: seconds each
def test_a_dataset_of_another_vocabulary_is_refused_naming_init_from(tmp_path):
    save_run(tmp_path)
    cfg = load_config(None, ["model.name=gpt", f"train.init_from={tmp_path / 'run'}"])
    other = {**META, "vocab_size": 64}
    with pytest.raises(ConfigError, match=r"train\.init_from.*vocabulary of 40 tokens.*vocabulary of 64"):
        init_from.resolve(cfg, build(cfg, other, seed=0), other)


@pytest.mark.slow   # DCP save and load: seconds each
def test_another_architecture_or_no_checkpoint_is_refused(tmp_path):
    save_run(tmp_path)
    cfg = load_config(None, ["model.name=gpt", "model.size=mini", f"train.init_from={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"does not fit the one this config builds"):
        init_from.resolve(cfg, build(cfg, META, seed=0), META)
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        cfg = load_config(None, ["model.name=gpt", f"train.init_from={path}"])
        with pytest.raises(ConfigError, match=r"train\.init_from"):
            init_from.resolve(cfg, build(cfg, META, seed=0), META)


def test_a_hugging_face_directory_becomes_the_models_weights(tmp_path):
    (tmp_path / "hf").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "hf" / name).write_text("{}")
    cfg = init_from.as_hf_weights(load_config(None, ["model.name=hf", f"train.init_from={tmp_path / 'hf'}"]), "hf")
    assert cfg.model.options["weights"] == str(tmp_path / "hf")
    with pytest.raises(ConfigError, match="model.name is 'gpt'"):
        init_from.as_hf_weights(load_config(None, [f"train.init_from={tmp_path / 'hf'}"]), "gpt")
