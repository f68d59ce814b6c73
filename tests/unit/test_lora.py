"""train.lora: its settings and refusals, apply_lora on a model built on meta (as a worker builds it), the base
weights frozen and bitwise unchanged by training, and the optimizer holding the adapters alone. One process, no
process group: the layouts are tests/dist/test_lora_resume.py's. Tests that inject adapters import peft, which
imports transformers (~5 s): marked slow, as the project's other transformers tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raydl.config_lora import lora_settings
from raydl.errors import ConfigError
from raydl.models.choice import choose_model
from raydl.models.lora import apply_lora, is_adapter, merge_adapters
from raydl.overrides import load_config
from raydl.train.engines import build_engine
from raydl.train.model_build import build_for_worker
from raydl.train.optim import build_optimizer

META = {"vocab_size": 17, "seq_len": 8}
COMMON = ["model.size=tiny", "train.global_batch_size=4", "train.micro_batch_size=4", "train.seed=3",
          "train.weight_decay=0.1", "train.lr=0.01"]


def _engine(*sets: str):
    cfg = load_config(None, [*COMMON, *sets])
    chosen = choose_model(cfg.model)
    model, init = build_for_worker(chosen, META, cfg)
    session = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    return cfg, chosen, build_engine(model, cfg, chosen.spec, session, META, init)


def test_settings_defaults_and_set_paths():
    cfg = load_config(None, ["train.lora.rank=4", "train.lora.targets=[qkv]"])
    assert lora_settings(cfg.train.lora) == lora_settings({"rank": 4, "alpha": 8, "targets": ["qkv"]})
    assert lora_settings(load_config(None, []).train.lora) is None   # off by default
    assert lora_settings({"rank": 8}).targets == "all-linear" and lora_settings({"rank": 8}).alpha == 16


@pytest.mark.parametrize("sets, field", [
    (["train.lora.alpha=16"], "train.lora.rank"),
    (["train.lora.rank=0"], "train.lora.rank"),
    (["train.lora.rank=4", "train.lora.dropout=1.5"], "train.lora.dropout"),
    (["train.lora.rank=4", "train.lora.ranks=3"], "train.lora.ranks"),
    (["train.lora.rank=4", "train.precision=fp8"], "train.precision"),
    (["train.lora.rank=4", "train.optimizer_in_backward=true", "train.grad_clip=0"], "train.optimizer_in_backward"),
])
def test_bad_settings_are_refused_naming_the_field(sets, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config(None, sets)


@pytest.mark.parametrize("targets, says", [("[nothing_here]", "matches no module"),
                                           pytest.param("[head]", "peft cannot wrap", marks=pytest.mark.slow)])
def test_targets_that_cannot_be_wrapped_are_refused(targets, says):
    cfg = load_config(None, [*COMMON, "train.lora.rank=2", f"train.lora.targets={targets}"])
    chosen = choose_model(cfg.model)
    with torch.device("meta"):
        model = chosen.build(META)
    with pytest.raises(ConfigError, match=f"'train.lora.targets'.*{says}"):
        apply_lora(model, settings=lora_settings(cfg.train.lora))


@pytest.mark.slow   # imports peft
def test_all_linear_leaves_the_head_and_freezes_the_base():
    _, _, engine = _engine("train.lora.rank=2")
    names = {n for n, _ in engine.model.named_parameters()}
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and trainable == {n for n in names if is_adapter(n)}
    assert not any(n.startswith("blocks.head.") for n in trainable)
    assert any(".qkv.lora_A." in n for n in trainable) and any(".mlp.2.lora_B." in n for n in trainable)


@pytest.mark.slow   # imports peft
def test_training_changes_adapters_only_and_the_optimizer_holds_them_alone():
    cfg, chosen, engine = _engine("train.lora.rank=2", "train.lora.alpha=4")
    model = engine.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # B starts at zero (peft's init): the adapted model starts as the base model
    assert all(bool((p == 0).all()) for n, p in before.items() if ".lora_B." in n)
    assert all(bool(p.isfinite().all()) and bool((p != 0).any()) for n, p in before.items() if ".lora_A." in n)
    optimizer = build_optimizer(engine.parameters(), cfg.train)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in model.named_parameters() if is_adapter(n)}
    assert held == adapters
    torch.manual_seed(0)
    for _ in range(3):
        engine.forward_backward(_batch(chosen), scaler=None)
        optimizer.step()
        optimizer.zero_grad()
    assert {id(p) for p in optimizer.state} == adapters   # AdamW moments for the adapters alone
    for n, p in model.named_parameters():
        if is_adapter(n):
            continue
        assert torch.equal(p.detach(), before[n]), f"{n} changed: the base must stay bitwise the same"
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if ".lora_B." in n)


@pytest.mark.slow   # imports peft
def test_merge_gives_the_adapted_models_outputs():
    _, chosen, engine = _engine("train.lora.rank=2")
    model = engine.model.eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
        x = chosen.spec.example_inputs(META, 2)
        adapted = model(x)
        merged = merge_adapters(model)
        assert not any(is_adapter(n) for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(x), adapted, rtol=0, atol=1e-5)


def _batch(chosen) -> dict[str, torch.Tensor]:
    x = chosen.spec.example_inputs(META, 4)
    return {"input_ids": x, "labels": torch.roll(x, -1, dims=1)}


@pytest.mark.slow   # imports peft
def test_memory_prediction_counts_gradients_and_optimizer_states_of_the_adapters_alone():
    from raydl.parallel.memory import predict
    from raydl.parallel.memory_probe import model_memory

    cfg = load_config(None, COMMON)
    chosen = choose_model(cfg.model)
    with torch.device("meta"):
        full, adapted = chosen.build(META), chosen.build(META)
    apply_lora(adapted, settings=lora_settings({"rank": 2}))
    adapter_bytes = sum(p.numel() * 4 for n, p in adapted.named_parameters() if is_adapter(n))
    before, after = (predict(model_memory(m, chosen.spec, META), dp=2, pp=1, micro_batch=4, wrapper="ddp")
                     for m in (full, adapted))
    assert after.parts["weights"] == before.parts["weights"] + adapter_bytes   # the base is still held whole
    assert after.parts["grads"] == after.parts["ddp buckets"] == adapter_bytes
    assert after.parts["optimizer"] == 2 * adapter_bytes                       # adamw's two moments
    assert before.parts["grads"] == before.parts["weights"]


@pytest.mark.slow   # imports peft
def test_base_weights_load_from_a_checkpoint_of_full_training(tmp_path):
    """train.init_from with LoRA: the checkpoint names `q.weight`, the adapted model `q.base_layer.weight`."""
    from raydl.train import checkpoint as ckpt

    cfg = load_config(None, COMMON)
    chosen = choose_model(cfg.model)
    torch.manual_seed(11)
    trained = chosen.build(META)
    state = {"step": 1, "samples": 4, "position": {"epoch": 0, "offset": 4}, "model": chosen.fingerprint(trained),
             "layout": {"world_size": 1}, "scaler": None, "lr": 0.0, "saved_by_ranks": 1}
    with pytest.warns(UserWarning, match="torch.distributed"):
        ckpt.save(tmp_path / "step_1", trained, build_optimizer(trained.parameters(), cfg.train), state, rank=0)
    _, _, engine = _engine("train.lora.rank=2")
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if is_adapter(n)}
    with pytest.warns(UserWarning, match="torch.distributed"):
        ckpt.load_weights(tmp_path / "step_1", engine.model)
    saved = dict(trained.named_parameters())
    for name, p in engine.model.named_parameters():
        if is_adapter(name):
            assert torch.equal(p, before[name]), f"{name}: the adapters are not in a full checkpoint"
        else:
            assert torch.equal(p, saved[name.replace(".base_layer.", ".")]), name


def test_raydl_train_refuses_targets_that_match_nothing_before_ray_starts(tiny_overrides, tmp_path, capsys):
    from raydl.cli import main

    runs = tmp_path / "runs"   # tiny_overrides' run.runs_dir
    sets = [*tiny_overrides, "train.lora.rank=2", "train.lora.targets=[q_proj]"]
    assert main(["train", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert "'train.lora.targets'" in err and "matches no module" in err and "Fix:" in err and "Traceback" not in err
    assert not runs.exists()


def test_the_base_digest_follows_the_weights_files_and_a_changed_base_is_refused(tmp_path):
    from raydl.driver.lora_base import check_same_base, lora_fingerprint

    (tmp_path / "model.safetensors").write_bytes(b"weights, version 1")
    sets = ["model.name=hf", f"model.options.weights={tmp_path}", "train.lora.rank=4"]
    first = lora_fingerprint(load_config(None, sets), None)
    assert first["lora_base"] == str(tmp_path) and first["lora"] == "rank=4 alpha=8 dropout=0 targets=all-linear"
    assert lora_fingerprint(load_config(None, sets), None) == first
    check_same_base(first, dict(first), "ckpt")   # the same base: resumes
    (tmp_path / "model.safetensors").write_bytes(b"weights, version 2")
    changed = lora_fingerprint(load_config(None, sets), None)
    assert changed["lora_base_digest"] != first["lora_base_digest"]
    with pytest.raises(ConfigError, match="'train.init_from'.*were trained on"):
        check_same_base(first, changed, "ckpt")
    assert lora_fingerprint(load_config(None, []), None) == {}   # no LoRA: nothing recorded


@pytest.mark.parametrize("args, field", [(["--adapter", "a", "--out", "b"], "--adapter"),
                                         (["--adapter", "a", "--format", "hf"], "--adapter"),
                                         (["--format", "hf"], "--out")])
def test_export_arguments_that_contradict_exit_2(args, field, tmp_path, capsys):
    from raydl.cli import main

    assert main(["export", str(tmp_path), *args]) == 2
    assert f"'{field}'" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
