"""model.name=hf on meta: the workers' build allocates nothing until materialized, with transformers' own init
per module (seeded by name) or model.options.weights read per module; a weights directory missing a shard, a
tensor, or of another shape is refused from its headers before anything is read."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from raydl.errors import ConfigError
from raydl.models.choice import choose_model
from raydl.models.hf.model import build_causal_lm
from raydl.models.hf.options import HfOptions
from raydl.models.hf.weights import FIELD
from raydl.overrides import load_config
from raydl.train.model_build import build_for_worker

META = {"vocab_size": 61, "seq_len": 16, "eos": 60}
LLAMA = ("model.name=hf", "model.options.family=llama", "model.options.layers=2", "model.options.hidden_size=32",
         "model.options.kv_heads=2")


def _worker_model(*sets: str):
    """What a worker builds (on meta), materialized whole on the CPU as a dp=1 rank does."""
    cfg = load_config(None, [*sets, "train.seed=5"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the untie warning
        model, init = build_for_worker(choose_model(cfg.model), META, cfg)
    assert init is not None and all(t.is_meta for t in model.parameters())
    init(model, torch.device("cpu"))
    return model.eval()


@pytest.fixture
def saved(tmp_path):
    """A tiny tied Llama written by save_pretrained, its weights unlike any init, sharded in 3 files."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_causal_lm(HfOptions(family="llama", num_hidden_layers=2, hidden_size=32, num_key_value_heads=2,
                                          config_fields={"tie_word_embeddings": True}), META).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.config.tie_word_embeddings = True   # as a tied checkpoint is saved: no lm_head.weight in the files
    model.save_pretrained(tmp_path / "saved", max_shard_size="20KB")
    return tmp_path / "saved", model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_tied_head_starts_as_a_copy_of_the_embeddings_on_meta(family):
    sets = ("model.name=hf", f"model.options.family={family}", "model.options.layers=2",
            "model.options.hidden_size=32", "model.options.tie_word_embeddings=true")
    model = _worker_model(*sets[:-1] if family == "gpt2" else sets)   # GPT-2 ties by default
    embed = model.blocks["embed"].wte if family == "gpt2" else model.blocks["embed"].embed_tokens
    head = model.blocks["head"].lm_head.weight
    assert head is not embed.weight and torch.equal(head, embed.weight)
    assert 0.015 < float(head.std()) < 0.025   # transformers' normal(0, initializer_range=0.02)


def test_initial_values_are_transformers_init_with_rotary_recomputed():
    model = _worker_model(*LLAMA)
    layer = model.blocks["h0"]
    assert torch.equal(layer.layer.input_layernorm.weight, torch.ones(32))   # RMSNorm: ones
    head_dim = 32 // 4
    expected = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    torch.testing.assert_close(layer.rotary.inv_freq, expected)
    assert not torch.equal(layer.layer.self_attn.q_proj.weight, model.blocks["h1"].layer.self_attn.q_proj.weight)
    again = _worker_model(*LLAMA)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_weights_read_on_meta_give_the_logits_of_the_saved_model(saved):
    folder, reference = saved
    assert len(list(folder.glob("*.safetensors"))) > 2
    model = _worker_model("model.name=hf", f"model.options.weights={folder}")
    ids = torch.randint(0, META["vocab_size"], (2, META["seq_len"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids, use_cache=False).logits, rtol=0, atol=1e-6)
    assert torch.equal(model.blocks["head"].lm_head.weight, reference.model.embed_tokens.weight)


def _refused(folder, match: str) -> ConfigError:
    with pytest.raises(ConfigError, match=match) as refused:
        _worker_model("model.name=hf", f"model.options.weights={folder}")
    return refused.value


def test_a_missing_shard_is_refused_from_the_index(saved):
    folder, _ = saved
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[1].unlink()
    assert _refused(folder, rf"misses 1 of the {len(shards)} shard files.*{shards[1].name}").path == FIELD


def test_a_missing_tensor_or_a_wrong_shape_is_refused_from_the_headers(saved):
    folder, _ = saved
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    save_file({k: v for k, v in tensors.items() if k != name}, shard)
    assert _refused(folder, rf"lacks 1 of the model's \d+ tensors \(first: {name}\)").path == FIELD
    save_file({**tensors, name: tensors[name][:, :3].contiguous()}, shard)
    assert _refused(folder, rf"does not fit its config.json: {name} is F32 \[32, 3\], the model's is \[32, 128\]").path == FIELD


def test_a_file_that_is_not_safetensors_is_refused(saved):
    folder, _ = saved
    next(folder.glob("model-*.safetensors")).write_bytes(b"\xff" * 64)
    assert _refused(folder, r"is not a readable safetensors file").path == FIELD


def test_train_with_a_weights_dir_missing_a_shard_exits_2_before_anything_is_written(tmp_path, capsys):
    from examples.random_llama import write_tokens, write_weights
    from raydl.cli import main

    write_weights(tmp_path / "llama")
    assert main(["data", "prepare", str(write_tokens(tmp_path / "src", 512)), "--from", "parquet", "--out",
                 str(tmp_path / "data"), "--quiet"]) == 0
    (tmp_path / "llama" / "model-00003-of-00006.safetensors").unlink()
    sets = ["model.name=hf", f"model.options.weights={tmp_path / 'llama'}", f"data.path={tmp_path / 'data'}",
            f"run.runs_dir={tmp_path / 'runs'}", "parallel.pp_degree=2"]
    capsys.readouterr()
    assert main(["train", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert "model.options.weights" in err and "misses 1 of the 6 shard files its model.safetensors.index.json names: model-00003" in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
