"""Building on meta without processes: initial values as a function of (seed, module name), stage cuts that
allocate nothing, non-persistent buffers recomputed, and the fallback (one warning line) for modules that
cannot be built on meta. The multi-process layouts are in tests/dist/test_meta_build.py."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import raydl
from raydl.data.builtin import IMAGES_META, TOKENS_META
from raydl.models.choice import ModelChoice, choose_model
from raydl.overrides import load_config
from raydl.parallel.materialize import MetaInit
from raydl.parallel.pipeline import split_stages
from raydl.train.engines import build_engine
from raydl.train.model_build import build_for_worker
from raydl.train.optim import build_optimizer
from raydl.train.step import optimizer_step

CPU = torch.device("cpu")
FEATURES = {"num_features": 4}


def _gpt(*sets: str):
    cfg = load_config(None, ["model.size=tiny", *sets])
    return choose_model(cfg.model), cfg


def _materialized(*sets: str) -> dict[str, torch.Tensor]:
    chosen, cfg = _gpt(*sets)
    model, init = build_for_worker(chosen, TOKENS_META, cfg)
    init(model, CPU)
    return model.state_dict()


def test_gpt_builds_on_meta_and_allocates_nothing_before_materializing():
    chosen, cfg = _gpt()
    model, init = build_for_worker(chosen, TOKENS_META, cfg)
    assert init is not None and all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    init(model, CPU)
    assert not any(t.is_meta for t in model.parameters())
    std = model.blocks["h0"].mlp[0].weight.std()
    assert 0.015 < std < 0.025, std   # the spec's init_weights (GPT-2's N(0, 0.02)) ran after reset_parameters


def test_initial_values_depend_on_seed_and_name_only():
    one, again, other = _materialized(), _materialized(), _materialized("train.seed=1")
    assert all(torch.equal(one[k], again[k]) for k in one)
    assert not torch.equal(one["blocks.h0.attn.qkv.weight"], other["blocks.h0.attn.qkv.weight"])
    # two modules of the same shape and class draw different values: the name is in the seed
    assert not torch.equal(one["blocks.h0.attn.qkv.weight"], one["blocks.h1.attn.qkv.weight"])


def test_a_by_rows_spec_draws_each_block_of_rows_under_its_own_seed():
    """gpt's spec sets init_by_rows: a tensor's rows are drawn in ROWS_PER_DRAW blocks, each seeded by (seed, name,
    block), so an FSDP2 rank can draw only the blocks holding its rows (tests/dist/test_meta_build.py: every
    layout still starts from the same bits). The last block is shorter."""
    from raydl.models.gpt import _init_weights
    from raydl.parallel.materialize import ROWS_PER_DRAW, _name_seed

    rows = 3 * ROWS_PER_DRAW - 5
    with torch.device("meta"):
        linear = nn.Linear(8, rows)
    MetaInit(3, {linear: "h0.qkv"}, _init_weights, by_rows=True)(linear, CPU)
    for block in range(3):
        torch.manual_seed(_name_seed(3, f"h0.qkv#rows{block}"))
        part = nn.Linear(8, min(ROWS_PER_DRAW, rows - block * ROWS_PER_DRAW))   # its reset_parameters, then:
        _init_weights(part)
        start = block * ROWS_PER_DRAW
        assert torch.equal(linear.weight[start:start + part.out_features], part.weight)
        assert torch.equal(linear.bias[start:start + part.out_features], part.bias)
    whole = nn.Linear(8, rows, device="meta")
    MetaInit(3, {whole: "h0.qkv"}, _init_weights)(whole, CPU)   # a spec without init_by_rows: one draw
    assert not torch.equal(whole.weight, linear.weight)


def test_stages_materialized_apart_equal_the_whole_model_without_copying_it():
    whole = _materialized()
    chosen, cfg = _gpt()
    model, init = build_for_worker(chosen, TOKENS_META, cfg)
    first, last = split_stages(model, (2, 3, 5), (0, 3))     # V placement, rank 0: two stages
    assert list(model.blocks) == ["embed", "h0", "head"]    # the other stages' blocks are gone, not copied
    assert first.blocks["h0"] is model.blocks["h0"]
    init(first, CPU)
    assert all(p.is_meta for p in last.parameters())       # a stage's materialization touches no other stage
    init(last, CPU)
    for stage in (first, last):
        for name, t in stage.state_dict().items():
            assert torch.equal(t, whole[name]), name


class Rotary(nn.Module):
    """Owns a non-persistent buffer computed in __init__: to_empty leaves it unset."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq.repeat(2)


class Net(nn.Module):
    def __init__(self, features: int, scale: bool = False):
        super().__init__()
        self.inp = nn.Linear(features, 8)
        self.rot = Rotary(8)
        self.out = nn.Linear(8, 1)
        if scale:
            self.scale = nn.Parameter(torch.ones(1))   # owned directly by Net, which has no reset_parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(self.rot(self.inp(x)))
        return y * self.scale if hasattr(self, "scale") else y


def _recompute_rotary(module: nn.Module) -> None:
    if isinstance(module, Rotary):
        module.inv_freq.copy_(module._inv_freq())


def _net_spec(build=lambda options, meta: Net(meta["num_features"]), init_weights=_recompute_rotary):
    return raydl.ModelSpec(name="net", build=build, inputs_targets=lambda b: (b["x"], b["y"]),
                           loss=nn.functional.mse_loss, example_inputs=lambda meta, n: torch.randn(n, 4),
                           blocks=("inp", "rot", "out"), init_weights=init_weights)


def _net_choice(spec) -> tuple[ModelChoice, object]:
    cfg = load_config(None, ["train.lr=0.05"])
    return choose_model(cfg.model, spec), cfg


def test_a_plain_module_builds_on_meta_and_recomputes_its_non_persistent_buffer():
    chosen, cfg = _net_choice(_net_spec())
    model, init = build_for_worker(chosen, FEATURES, cfg)
    assert init is not None
    init(model, CPU)
    torch.testing.assert_close(model.blocks["rot"].inv_freq, Rotary(8).inv_freq, rtol=0, atol=0)


def test_a_buffer_that_no_init_sets_is_an_error_naming_it():
    chosen, cfg = _net_choice(_net_spec(init_weights=lambda module: None))
    model, init = build_for_worker(chosen, FEATURES, cfg)
    with pytest.raises(ValueError, match=r"blocks\.rot\.inv_freq was not set"):
        init(model, CPU)


def _fallback(spec, caplog) -> tuple[nn.Module, str]:
    chosen, cfg = _net_choice(spec)
    with caplog.at_level(logging.WARNING, logger="raydl"):
        model, init = build_for_worker(chosen, FEATURES, cfg)
    assert init is None and not any(p.is_meta for p in model.parameters())
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    return model, lines[0]


def _needs_values(options, meta):
    net = Net(meta["num_features"])
    if float(net.inp.weight.detach().sum()) > 1e9:   # reads a value: impossible on meta
        raise AssertionError
    return net


def test_a_build_that_reads_values_falls_back_with_one_warning(caplog):
    _, line = _fallback(_net_spec(build=_needs_values), caplog)
    assert "not on meta" in line and "on the meta device" in line


def test_a_module_owning_parameters_without_reset_parameters_falls_back(caplog):
    spec = _net_spec(build=lambda options, meta: Net(meta["num_features"], scale=True), init_weights=None)
    _, line = _fallback(dataclasses.replace(spec, blocks=None), caplog)
    assert "blocks.model (Net) owns scale directly and has no reset_parameters" in line


def test_the_fallback_still_trains(caplog):
    chosen, cfg = _net_choice(_net_spec(build=_needs_values))
    model, _ = _fallback(chosen.spec, caplog)
    session = SimpleNamespace(rank=0, world_size=1, device=CPU)
    engine = build_engine(model, cfg, chosen.spec, session, FEATURES)
    optimizer = build_optimizer(engine.parameters(), cfg.train)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    batch = {"x": x, "y": x.sum(1, keepdim=True)}
    losses = []
    for _ in range(30):
        losses.append(float(engine.forward_backward(batch, scaler=None).loss))
        optimizer_step(optimizer, None, clip=engine.clip(0.0))
    assert losses[-1] < 0.5 * losses[0], losses


def test_pp_auto_profiles_a_meta_model_one_real_block_at_a_time():
    chosen, cfg = _gpt("parallel.pp_degree=auto")
    model, init = build_for_worker(chosen, TOKENS_META, cfg)
    assert init is not None
    copies = []

    class Watched(MetaInit):
        def real_copy(self, module, device):
            assert all(p.is_meta for p in model.parameters()), "the model itself stays on meta while profiled"
            copies.append(super().real_copy(module, device))
            return copies[-1]

    watched = Watched(init.seed, init.names, init.init_weights)
    session = SimpleNamespace(rank=0, world_size=1, device=CPU)
    engine = build_engine(model, cfg, chosen.spec, session, TOKENS_META, watched)
    assert len(copies) == len(model.blocks) and engine.layout.pp == 1
    assert not any(p.is_meta for p in engine.parameters())


def test_resnet_batch_norm_statistics_are_set_after_to_empty_the_integer_counter_included():
    cfg = load_config(None, ["model.name=resnet"])
    chosen = choose_model(cfg.model)
    model, init = build_for_worker(chosen, IMAGES_META, cfg)
    assert init is not None
    init(model, CPU)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(torch.equal(m.running_var, torch.ones_like(m.running_var)) for m in norms)
    assert all(int(m.num_batches_tracked) == 0 for m in norms)   # no NaN to catch an unset integer
