"""The model contract without processes: built-in specs and their options, plain modules made into
blocks (and the check that the blocks equal forward), the LayoutError without blocks, raydl's surface."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import raydl
from raydl.cli import main
from raydl.data.builtin import IMAGES_META, TOKENS_META
from raydl.errors import ConfigError, LayoutError
from raydl.models.blocks import BlockModel, num_params
from raydl.models.build import WHOLE, build_model
from raydl.models.choice import choose_model
from raydl.models.gpt import build_gpt
from raydl.models.presets import BUILTIN_OPTIONS
from raydl.overrides import load_config

META = {"num_features": 6}
REPO = Path(__file__).resolve().parents[2]


def _choice(*sets: str):
    return choose_model(load_config(None, list(sets)).model)


def test_builtin_fingerprint_is_the_one_checkpoints_already_hold():
    chosen = _choice("model.size=tiny")
    model = chosen.build(TOKENS_META)
    before = build_gpt("tiny", vocab_size=TOKENS_META["vocab_size"], seq_len=TOKENS_META["seq_len"])
    assert chosen.fingerprint(model) == {"name": "gpt", "size": "tiny", "params": num_params(before), "blocks": 6}
    resnet = _choice("model.name=resnet")
    assert resnet.fingerprint(resnet.build(IMAGES_META))["name"] == "resnet"


def test_gpt_options_override_the_preset_dimensions():
    chosen = _choice("model.size=mini", "model.options.layers=2", "model.options.width=64", "model.options.heads=2",
                     "model.options.seq_len=32", "model.options.vocab=40", "model.dropout=0.1")
    model = chosen.build(TOKENS_META)
    assert model.block_names == ["embed", "h0", "h1", "head"]
    assert model.blocks["embed"].pos.weight.shape == (32, 64) and model.blocks["head"].out.weight.shape == (40, 64)
    assert model.blocks["h0"].attn.dropout == 0.1
    assert chosen.flops_per_sample(TOKENS_META) < _choice("model.size=mini").flops_per_sample(TOKENS_META)


def test_resnet_options_and_yaml_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name: resnet\n  options: {widths: [8, 16], blocks: 2}\n")
    chosen = choose_model(load_config(path).model)
    model = chosen.build(IMAGES_META)
    assert model.block_names == ["stem", "b0", "b1", "b2", "b3", "head"]
    assert model.blocks["head"].fc.in_features == 16
    assert chosen.flops_per_sample(IMAGES_META) is None   # unknown, not guessed


@pytest.mark.parametrize("sets, field", [
    (["model.options.layerz=2"], "model.options.layerz"),
    (["model.options.layers=two"], "model.options.layers"),
    (["model.options.size=mini"], "model.options.size"),
    (["model.size=huge"], "model.size"),
    (["model.options.width=100", "model.options.heads=3"], "model.options.width"),
    (["model.options.seq_len=4"], "model.options.seq_len"),
    (["model.name=resnet", "model.dropout=0.2"], "model.dropout"),
    (["model.name=resnet", "model.options.widths=[8, -1]"], "model.options.widths"),
    (["model.options=5"], "model.options"),
    (["model.name.x=1"], "model.name.x"),
])
def test_bad_options_name_the_field(sets, field):
    with pytest.raises(ConfigError) as e:
        _choice(*sets).build(TOKENS_META)
    assert f"'{field}'" in str(e.value) and "Fix:" in str(e.value)


def test_help_lists_the_builtin_options(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for model in BUILTIN_OPTIONS:
        assert f"\n  {model}:" in out
    assert "model.options.layers = 0" in out and "model.options.widths = []" in out


class Net(nn.Module):
    """forward = inp, act, out: with `act` a block of its own, the three blocks equal forward."""

    def __init__(self):
        super().__init__()
        self.inp, self.act, self.out, self.unused = nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)))


class Twice(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.act(self.inp(x))))


class MoreAfter(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x))) * 2


def _spec(module_class=Net, blocks=None) -> raydl.ModelSpec:
    return raydl.ModelSpec(name="net", build=lambda options, meta: module_class(), loss=F.mse_loss,
                           inputs_targets=lambda batch: (batch["x"], batch["y"]), blocks=blocks,
                           example_inputs=lambda meta, n: torch.randn(n, meta["num_features"]))


def test_blocks_that_equal_forward_become_a_block_model_of_those_children():
    model = build_model(_spec(blocks=("inp", "act", "out")), {}, META, pp_degree=2)
    assert isinstance(model, BlockModel) and model.block_names == ["inp", "act", "out"]
    assert {n for n, _ in model.named_parameters()} == {"blocks.inp.weight", "blocks.inp.bias", "blocks.out.weight",
                                                        "blocks.out.bias"}   # `unused` is not a block: not trained
    assert model.training


@pytest.mark.parametrize("module_class, blocks, names", [
    (Net, ("inp", "out"), "block 'out' is the first whose output differs"),        # act is applied between
    (Net, ("act", "inp", "out"), "block 'act' is the first whose output differs"),  # wrong order
    (Twice, ("inp", "act", "out"), "calls block 'act' 2 times"),
    (MoreAfter, ("inp", "act", "out"), "forward does more after it"),
    (Net, ("inp", "actt", "out"), "names 'actt', which is not a top-level child"),
    (Net, (), "is empty"),
])
def test_blocks_that_do_not_equal_forward_are_refused_naming_the_block(module_class, blocks, names):
    with pytest.raises(ConfigError, match="model.name") as e:
        build_model(_spec(module_class, blocks), {}, META, pp_degree=1)
    assert names in str(e.value) and "ModelSpec.blocks" in str(e.value)


def test_blocks_are_not_run_on_the_meta_device():
    with torch.device("meta"):   # what the driver builds: names are checked, values cannot be
        model = build_model(_spec(Twice, ("inp", "act", "out")), {}, META, pp_degree=1)
    assert model.block_names == ["inp", "act", "out"]


def test_a_plain_module_without_blocks_is_one_block_at_pp1_and_refused_for_a_pipeline():
    model = build_model(_spec(), {}, META, pp_degree=1)
    assert model.block_names == [WHOLE] and model(torch.randn(3, 6)).shape == (3, 2)
    for pp in (2, "auto"):
        with pytest.raises(LayoutError, match="without ModelSpec.blocks") as e:
            build_model(_spec(), {}, META, pp_degree=pp)
        assert f"parallel.pp_degree is {pp}" in str(e.value) and "Fix:" in str(e.value)


def test_options_dataclass_of_a_user_spec_is_strict_and_takes_model_dropout():
    from dataclasses import dataclass

    @dataclass(kw_only=True)
    class Options:
        width: int
        dropout: float = 0.0

    spec = raydl.ModelSpec(name="mine", build=lambda o, meta: nn.Linear(o.width, 1), loss=F.mse_loss,
                           inputs_targets=lambda b: (b["x"], b["y"]), example_inputs=lambda meta, n: torch.randn(n, 3),
                           options=Options)
    cfg = load_config(None, ["model.options.width=3", "model.dropout=0.5"])
    assert choose_model(cfg.model, spec).options == Options(width=3, dropout=0.5)
    with pytest.raises(ConfigError, match="'model.options.width' is required"):
        choose_model(load_config(None, []).model, spec)
    with pytest.raises(ConfigError, match="'model.size' is 'mini', but model 'mine' has no size option"):
        choose_model(load_config(None, ["model.size=mini", "model.options.width=3"]).model, spec)


def test_import_raydl_loads_neither_torch_nor_ray():
    code = ("import sys, raydl; raydl.ModelSpec; raydl.ConfigError; raydl.train; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert callable(raydl.train) and raydl.train.__name__ == "raydl.train"   # also the loop's package
    assert {"train", "sweep", "ModelSpec", "BlockModel", "ConfigError", "DataError", "CheckpointError",
            "RaydlError"} <= set(dir(raydl))


def test_import_path_models_record_the_directory_they_were_found_in(tmp_path, monkeypatch):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("from examples.mlp_classifier import spec\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(REPO)
    assert choose_model(load_config(None, ["model.name=examples.mlp_classifier:spec"]).model).import_dir == str(REPO)
    monkeypatch.chdir(tmp_path)
    try:
        assert choose_model(load_config(None, ["model.name=pkg.sub:spec"]).model).import_dir == str(tmp_path)
    finally:
        for name in ("pkg.sub", "pkg"):
            sys.modules.pop(name, None)
    assert _choice("model.name=gpt").import_dir == ""
