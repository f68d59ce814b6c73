"""Pure checks of the pipeline layout: stage placement, cuts, stage FQNs, and bad input -> LayoutError / exit 2."""

from __future__ import annotations

import warnings

import pytest
import torch

from raydl.cli import main as cli_main
from raydl.data.builtin import IMAGES_META, TOKENS_META
from raydl.driver.prepare import check_layout
from raydl.errors import LayoutError
from raydl.models.blocks import num_params
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.parallel.layout import Layout
from raydl.parallel.mesh import layout_for, validate
from raydl.parallel.pipeline import split_stages, stage_cuts
from raydl.parallel.profile import BlockProfile, ModelProfile
from raydl.parallel.schedules import stage_indices, stage_ranks


def _layout(schedule="1f1b", pp=2, m=4, cuts=(), dp=1) -> Layout:
    return Layout(world_size=dp * pp, dp=dp, pp=pp, micro_batch=2, num_microbatches=m, schedule=schedule,
                  stage_cuts=cuts)


@pytest.mark.parametrize("schedule, expected", [
    ("1f1b", [(0,), (1,)]), ("gpipe", [(0,), (1,)]),
    ("interleaved1f1b", [(0, 2), (1, 3)]), ("loopedbfs", [(0, 2), (1, 3)]), ("interleavedzb", [(0, 2), (1, 3)]),
    ("zbv", [(0, 3), (1, 2)]), ("dualpipev", [(0, 3), (1, 2)]),
])
def test_stage_placement_matches_torch(schedule, expected):
    assert [stage_indices(schedule, 2, r) for r in range(2)] == expected
    ranks = stage_ranks(schedule, 2)
    owned = [tuple(s for s, rank in enumerate(ranks) if rank == r) for r in range(2)]
    assert owned == [tuple(sorted(e)) for e in expected]


def test_default_cuts_balance_blocks_and_manual_cuts_win():
    assert stage_cuts(_layout("1f1b"), 6) == (3,)
    assert stage_cuts(_layout("zbv"), 6) == (1, 2, 4)          # 4 stages of 1, 1, 2, 2 blocks
    assert stage_cuts(_layout("1f1b", cuts=(1,)), 6) == (1,)


@pytest.mark.parametrize("name, meta", [("gpt", TOKENS_META), ("resnet", IMAGES_META)])
def test_example_inputs_feed_the_model_and_meta_builds_count_like_real_ones(name, meta):
    cfg = load_config(None, [f"model.name={name}", "model.size=tiny"])
    chosen = choose_model(cfg.model)
    model = chosen.build(meta)
    assert model(chosen.spec.example_inputs(meta, 2)).shape[0] == 2     # what the planner's profile runs
    with torch.device("meta"):                                            # what the driver counts (prepare_run)
        shapes_only = chosen.build(meta)
    assert (num_params(shapes_only), len(shapes_only.blocks)) == (num_params(model), len(model.blocks))


def test_stages_keep_global_parameter_names():
    cfg = load_config(None, [])
    model = choose_model(cfg.model).build({"vocab_size": 16, "seq_len": 8})
    full = {n for n, _ in model.named_parameters()}
    first, last = split_stages(model, (2, 3, 5), (0, 3))   # V placement, rank 0: stages 0 and 3
    assert list(first.blocks) == ["embed", "h0"] and list(last.blocks) == ["head"]
    names = {n for m in (first, last) for n, _ in m.named_parameters()}
    assert names < full and {"blocks.embed.tok.weight", "blocks.head.out.weight"} <= names
    assert all(n.startswith(("blocks.embed.", "blocks.h0.", "blocks.head.")) for n in names)


@pytest.mark.parametrize("layout, precision, wrapper, match", [
    (_layout("1f1b", m=1), "fp32", "fsdp", "num_microbatches >= pp"),
    (_layout("dualpipev", m=2), "fp32", "fsdp", "needs num_microbatches >= number of stages"),
    (_layout("zbv", pp=4, m=8), "fp32", "fsdp", "needs 8 stages"),
    (_layout("1f1b", cuts=(9,)), "fp32", "fsdp", "outside 1..5"),
    (_layout("1f1b", cuts=(1, 2)), "fp32", "fsdp", "has 2 cuts"),
    (_layout("1f1b"), "fp16", "fsdp", "fp16"),
    (_layout("zbv", dp=2), "fp32", "ddp", "144530"),
])
def test_bad_layouts_raise_with_numbers(layout, precision, wrapper, match):
    with pytest.raises(LayoutError, match=match):
        validate(layout, num_blocks=6, precision=precision, dp_wrapper=wrapper)


@pytest.mark.parametrize("schedule", ["zbv", "1f1b"])
def test_ddp_with_a_pipeline_is_refused_before_any_worker_starts(schedule):
    cfg = load_config(None, ["parallel.pp_degree=2", f"parallel.schedule={schedule}", "parallel.dp_wrapper=ddp",
                             "parallel.num_microbatches=4", "scaling.min_workers=4", "scaling.max_workers=4"])
    with pytest.raises(LayoutError, match="pytorch/pytorch#144530"):
        layout_for(cfg, 4, num_blocks=6)
    with pytest.raises(LayoutError, match="dp_wrapper=ddp does not work with pipeline parallelism"):
        check_layout(cfg, num_blocks=6)     # the driver's check: exit 2 before Ray starts


def _profile(num_blocks: int) -> ModelProfile:
    block = BlockProfile("b", fwd_s=1e-3, bwd_s=2e-3, param_bytes=2**20, activation_bytes=2**20, output_bytes=2**10)
    return ModelProfile((block,) * num_blocks, micro_batch=16)


def _elastic(*sets: str):
    return load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=16", "scaling.min_workers=1",
                              "scaling.max_workers=4", *sets])


def test_auto_pp_trains_the_closest_smaller_batch_where_explicit_pp_does():
    # 3 workers, 2 blocks: only pp=1 exists, and 64 does not split over dp=3.
    with pytest.warns(UserWarning, match="global batch of 63"):
        explicit = layout_for(_elastic(), 3, num_blocks=2)
    with pytest.warns(UserWarning, match="global batch of 63"):
        auto = layout_for(_elastic("parallel.pp_degree=auto"), 3, _profile(2), num_blocks=2,
                                  memory_bytes=2**40)
    assert (explicit.dp, explicit.pp, explicit.global_batch) == (auto.dp, auto.pp, auto.global_batch) == (3, 1, 63)
    fixed = load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=16", "scaling.min_workers=3",
                               "scaling.max_workers=3", "parallel.pp_degree=auto"])
    with pytest.raises(LayoutError):    # a fixed-size run never trains another batch, explicit or auto
        layout_for(fixed, 3, _profile(2), num_blocks=2, memory_bytes=2**40)


def test_auto_pp_keeps_the_global_batch_when_a_pipeline_can():
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # no smaller-batch warning: pp=3 splits 64 exactly
        layout = layout_for(_elastic("parallel.pp_degree=auto"), 3, _profile(6), num_blocks=6,
                                    memory_bytes=2**40)
    assert (layout.dp, layout.pp, layout.global_batch) == (1, 3, 64)


@pytest.mark.parametrize("sets, message", [
    (["parallel.pp_degree=8"], "not divisible by pp=8"),
    (["parallel.pp_degree=2", "parallel.schedule=nope"], "parallel.schedule"),
    (["parallel.pp_degree=2", "parallel.schedule=dualpipev", "parallel.num_microbatches=2"], "2*pp = 4"),
    (["parallel.pp_degree=2", "parallel.stage_cuts=[0]"], "outside 1..5"),
    (["parallel.pp_degree=2", "parallel.num_microbatches=5"], "not divisible"),
])
def test_plan_cli_exits_2_on_bad_layouts(sets, message, data_cache, capsys):
    argv = ["plan", "--workers", "4", "--set", f"data.cache_dir={data_cache}", "--set", "data.builtin_samples=4096"]
    for s in sets:
        argv += ["--set", s]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_plan_cli_prints_table(data_cache, capsys):
    assert cli_main(["plan", "--workers", "2", "--set", f"data.cache_dir={data_cache}",
                     "--set", "data.builtin_samples=4096"]) == 0
    out = capsys.readouterr().out
    assert "\n*" in out and "zbv" in out and "dualpipev" in out   # every pp and schedule is listed
