"""model.name=hf: the blocks reproduce the Hugging Face forward, options are strict, nothing is downloaded,
local weights load, the dataset's vocabulary must agree, tied embeddings are untied (with a warning)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from raydl.errors import ConfigError
from raydl.models.choice import choose_model
from raydl.models.hf.model import build, build_causal_lm, flops_per_sample
from raydl.models.hf.options import FAMILIES, HfOptions
from raydl.overrides import load_config

META = {"vocab_size": 61, "seq_len": 16, "eos": 60}


def _ids(rows: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, META["vocab_size"], (rows, META["seq_len"]), generator=torch.Generator().manual_seed(seed))


def _options(family: str, **kw) -> HfOptions:
    if family == "mistral":
        kw.setdefault("sliding_window", 5)   # shorter than the rows: the sliding mask matters
    return HfOptions(family=family, num_key_value_heads=2 if family != "gpt2" else 0, **kw)


def _pair(options: HfOptions):
    """raydl's blocks and the same-seed transformers model, both in eval mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # GPT-2's untie warning: its own test below
        torch.manual_seed(0)
        blocks = build(options, META).eval()
        torch.manual_seed(0)
        reference = build_causal_lm(options, META).eval()
    return blocks, reference


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_in_order_equal_the_transformers_forward(family, attention):
    blocks, reference = _pair(_options(family, attention=attention))
    assert list(blocks.blocks) == ["embed", "h0", "h1", "head"]
    ids = _ids()
    with torch.no_grad():
        ours, theirs = blocks(ids), reference(ids, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    # Causal: the first half's logits do not depend on the second half's tokens.
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % META["vocab_size"]
    with torch.no_grad():
        torch.testing.assert_close(blocks(changed)[:, :8], ours[:, :8], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_equal_the_transformers_forward_under_bf16_autocast(family):
    blocks, reference = _pair(_options(family))
    ids = _ids()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = blocks(ids), reference(ids, use_cache=False).logits
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_mistral_sliding_window_limits_what_a_token_sees():
    blocks, _ = _pair(_options("mistral", sliding_window=4))
    ids = _ids()
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1) % META["vocab_size"]
    with torch.no_grad():
        a, b = blocks(ids), blocks(changed)
    # Two layers of a 4-token window reach back 6 positions: position 10 never sees position 0.
    assert (a[:, 1] - b[:, 1]).abs().max() > 1e-4
    torch.testing.assert_close(a[:, 10:], b[:, 10:], rtol=0, atol=1e-6)


def test_gpt2_head_is_untied_with_a_warning_and_starts_as_the_embeddings():
    with pytest.warns(UserWarning, match="ties lm_head.weight .* its own parameter"):
        model = build(_options("gpt2"), META)
    wte, head = model.blocks["embed"].wte.weight, model.blocks["head"].lm_head.weight
    assert wte is not head and torch.equal(wte, head)
    names = [n for n, _ in model.named_parameters()]
    assert "blocks.embed.wte.weight" in names and "blocks.head.lm_head.weight" in names


def test_options_from_the_config_are_strict_and_typed():
    choice = choose_model(load_config(None, ["model.name=hf", "model.options.layers=3", "model.options.family=qwen2",
                                             "model.dropout=0.25"]).model)
    assert isinstance(choice.options, HfOptions)
    assert (choice.options.num_hidden_layers, choice.options.family, choice.options.dropout) == (3, "qwen2", 0.25)
    with pytest.raises(ConfigError, match="model.options.layer'"):
        choose_model(load_config(None, ["model.name=hf", "model.options.layer=3"]).model)
    with pytest.raises(ConfigError, match="model.options.family"):
        choose_model(load_config(None, ["model.name=hf", "model.options.family=gpt5"]).model)


def _hf(*sets: str):
    """The transformers model `--set model.name=hf --set ...` builds (on the meta device: shapes only)."""
    choice = choose_model(load_config(None, ["model.name=hf", *sets]).model)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # GPT-2's untie warning
        return build_causal_lm(choice.options, META)


def test_transformers_field_names_and_raydl_short_names_build_the_same_model():
    hf_names = _hf("model.options.num_hidden_layers=4", "model.options.num_attention_heads=8",
                   "model.options.num_key_value_heads=2", "model.options.max_position_embeddings=32")
    short = _hf("model.options.layers=4", "model.options.heads=8", "model.options.kv_heads=2",
                "model.options.max_positions=32")
    for model in (hf_names, short):
        c = model.config
        assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings) == \
            (4, 8, 2, 32) and len(model.model.layers) == 4
    gpt2 = _hf("model.options.family=gpt2", "model.options.n_layer=3", "model.options.n_embd=32",
               "model.options.layer_norm_epsilon=1e-4")
    assert (gpt2.config.n_layer, gpt2.config.n_embd, gpt2.config.layer_norm_epsilon) == (3, 32, 1e-4)


def test_any_field_of_the_family_config_class_reaches_the_config_typed():
    model = _hf("model.options.rope_theta=500000", "model.options.rms_norm_eps=1e-5",
                "model.options.attention_bias=true", "model.options.hidden_act=gelu")
    c = model.config
    assert (c.rope_parameters["rope_theta"], c.rms_norm_eps, c.attention_bias, c.hidden_act) == (5e5, 1e-5, True, "gelu")
    assert model.model.layers[0].self_attn.q_proj.bias is not None   # attention_bias built biases


@pytest.mark.parametrize("sets, message", [
    (["model.options.layers=3", "model.options.num_hidden_layers=4"],
     r"'model\.options\.num_hidden_layers' and model\.options\.layers are both given.*keep one of them"),
    (["model.options.family=gpt2", "model.options.n_head=2", "model.options.heads=4"],
     r"'model\.options\.heads' and model\.options\.n_head are both given"),
    (["model.options.num_hiden_layers=3"],
     r"'model\.options\.num_hiden_layers' is neither an option of model 'hf' nor a field of transformers' LlamaConfig"
     r".*did you mean num_hidden_layers\?"),
    (["model.options.family=gpt2", "model.options.rope_theta=1e6"], r"'model\.options\.rope_theta' .* GPT2Config"),
    (["model.options.rms_norm_eps=small"], r"'model\.options\.rms_norm_eps' must be of type float"),
    (["model.options.attention_dropout=0.1"], r"'model\.options\.attention_dropout' is set by raydl from "
                                              r"model\.dropout\. Fix: drop .* and set model\.dropout"),
    (["model.options.config_fields={rope_theta: 1}"], r"'model\.options\.config_fields' is filled by raydl"),
])
def test_bad_transformers_fields_are_config_errors_naming_the_option(sets, message):
    with pytest.raises(ConfigError, match=message):
        choose_model(load_config(None, ["model.name=hf", *sets]).model)


def test_dropout_reaches_every_dropout_of_the_family():
    _, model = _pair(_options("gpt2", dropout=0.3))
    assert (model.config.resid_pdrop, model.config.embd_pdrop, model.config.attn_pdrop) == (0.3, 0.3, 0.3)


@pytest.mark.parametrize("kw, field", [
    ({"hidden_size": 30}, "model.options.hidden_size"),          # not a multiple of 4 heads
    ({"num_key_value_heads": 3}, "model.options.num_key_value_heads"),
    ({"family": "gpt2", "num_key_value_heads": 2}, "model.options.num_key_value_heads"),
    ({"sliding_window": 8}, "model.options.sliding_window"),      # llama has none
    ({"num_hidden_layers": 0}, "model.options.num_hidden_layers"),
])
def test_impossible_dimensions_name_the_option(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        HfOptions(**kw)


def test_vocabulary_or_length_that_disagrees_with_the_dataset_names_both_numbers():
    with pytest.raises(ConfigError, match=r"model\.options\.vocab_size.* 100 tokens .* 61"):
        build(HfOptions(vocab_size=100), META)
    with pytest.raises(ConfigError, match=r"model\.options\.max_position_embeddings.* 8 positions .* 16 tokens"):
        build(HfOptions(max_position_embeddings=8), META)


def _save_pretrained(tmp_path, family: str = "llama", **kw):
    _, model = _pair(_options(family, **kw))
    with torch.no_grad():   # weights unlike any seed's init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "saved")
    return tmp_path / "saved", model


def test_config_dir_builds_its_architecture_and_weights_dir_loads_its_weights(tmp_path):
    saved, model = _save_pretrained(tmp_path, num_hidden_layers=3)
    from_config, _ = _pair(HfOptions(config=str(saved)))
    assert list(from_config.blocks) == ["embed", "h0", "h1", "h2", "head"]
    from_weights, _ = _pair(HfOptions(weights=str(saved)))
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(from_weights(ids), model(ids, use_cache=False).logits, rtol=0, atol=1e-6)
        assert (from_config(ids) - from_weights(ids)).abs().max() > 1e-2   # the config alone: random init


def test_gpt2_weights_load_untied_and_train_as_two_parameters(tmp_path):
    saved, model = _save_pretrained(tmp_path, family="gpt2")
    assert json.loads((saved / "config.json").read_text())["tie_word_embeddings"] is False
    loaded, _ = _pair(HfOptions(weights=str(saved)))
    torch.testing.assert_close(loaded.blocks["head"].lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


@pytest.mark.parametrize("field", ["config", "weights"])
def test_a_hub_name_is_refused_and_nothing_is_downloaded(field):
    with pytest.raises(ConfigError, match=fr"model\.options\.{field}.*Hugging Face Hub name; raydl never downloads"):
        build(HfOptions(**{field: "meta-llama/Llama-3.2-1B"}), META)


def test_bad_local_directories_are_refused_naming_the_option(tmp_path):
    saved, _ = _save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"model\.options\.config.*not a local directory holding config.json"):
        build(HfOptions(config=str(tmp_path)), META)
    with pytest.raises(ConfigError, match=r"model\.options\.num_hidden_layers.* comes from the config.json"):
        build(HfOptions(config=str(saved), num_hidden_layers=5), META)
    with pytest.raises(ConfigError, match=r"model\.options\.rope_theta.* comes from the config.json"):
        build(HfOptions(config=str(saved), config_fields={"rope_theta": 1e6}), META)
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="model_type 'bert'"):
        build(HfOptions(config=str(other)), META)
    (saved / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"model\.options\.weights.* no model.safetensors"):
        build(HfOptions(weights=str(saved)), META)


def test_a_weights_index_naming_files_outside_its_directory_is_refused(tmp_path):
    saved, _ = _save_pretrained(tmp_path)
    (saved / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (saved / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(ConfigError, match=r"model\.options\.weights.*\.\./elsewhere"):
        build(HfOptions(weights=str(saved)), META)


def test_shapes_only_build_counts_what_the_real_build_holds():
    options = _options("qwen2")
    with torch.device("meta"):
        shapes = build(options, META)
    real, _ = _pair(options)
    assert [n for n, _ in shapes.named_parameters()] == [n for n, _ in real.named_parameters()]
    assert sum(p.numel() for p in shapes.parameters()) == sum(p.numel() for p in real.parameters())


def test_flops_per_sample_counts_every_parameter_but_the_input_embeddings():
    options = _options("llama")
    _, model = _pair(options)
    n = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    layers, width, seq = 2, 64, META["seq_len"]
    assert flops_per_sample(options, META) == seq * (6 * n + 12 * layers * width * seq)


def test_activation_checkpointing_gives_the_same_gradients():
    from raydl.train.engines import apply_activation_checkpointing

    plain, _ = _pair(_options("llama"))
    checkpointed, _ = _pair(_options("llama"))
    apply_activation_checkpointing(checkpointed)
    ids = _ids()
    for model in (plain, checkpointed):
        model.train()
        model(ids).logsumexp(-1).mean().backward()
    names = [n.replace("._checkpoint_wrapped_module", "") for n, _ in checkpointed.named_parameters()]
    assert names == [n for n, _ in plain.named_parameters()]   # checkpoints keep their keys
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6)


def test_the_planner_profiles_every_block():
    from raydl.parallel.profile import profile_model

    blocks, _ = _pair(_options("gpt2"))
    choice = choose_model(load_config(None, ["model.name=hf"]).model)
    profile = profile_model(blocks, choice.spec, META, micro_batch=2, precision="fp32", device=torch.device("cpu"))
    assert [b.name for b in profile.blocks] == ["embed", "h0", "h1", "head"]
    assert all(b.fwd_s > 0 and b.param_bytes > 0 for b in profile.blocks)
    assert profile.blocks[-1].output_bytes == 2 * META["seq_len"] * META["vocab_size"] * 4   # fp32 logits
