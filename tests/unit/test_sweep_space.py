"""Sweep spec parsing and validation: everything that must fail before any trial starts (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raydl.cli import main
from raydl.errors import ConfigError
from raydl.models.choice import choose_model
from raydl.tune.space import default_sweep, parse_dim, parse_sweep, trial_config, trial_tree
from raydl.tune.sweep import max_concurrent, num_trials, prepare_data

ROOT = Path(__file__).resolve().parents[2]


def sweep(**kw):
    data = {"base": {"scaling": {"min_workers": 1, "max_workers": 1}},
            "space": {"train.global_batch_size": [32, 64], "train.precision": ["fp32", "bf16"]},
            "objective": "samples_per_s"}
    data.update(kw)
    return data


def test_dims_of_every_kind_become_tune_domains():
    from ray.tune.search.sample import Categorical, Float, Integer

    assert parse_dim("train.global_batch_size", [64, "128"]).values == (64, 128)   # coerced to int
    assert parse_dim("train.precision", "bf16").values == ("bf16",)                # a fixed value
    choice = parse_dim("train.precision", "choice([fp32, bf16])")
    assert choice.kind == "choice" and isinstance(choice.tune_domain(), Categorical)
    lr = parse_dim("train.lr", "loguniform(1e-4, 3e-3)")
    assert (lr.low, lr.high) == (1e-4, 3e-3) and isinstance(lr.tune_domain(), Float)
    assert isinstance(parse_dim("train.warmup_steps", "randint(0, 20)").tune_domain(), Integer)
    assert parse_dim("train.global_batch_size", [64, 128]).tune_domain() == {"grid_search": [64, 128]}


@pytest.mark.parametrize("path, raw, words", [
    ("train.global_batch", [64], ["'train.global_batch' is not a config field", "global_batch_size"]),
    ("trian.lr", [0.1], ["'trian' is not a config section", "train"]),
    ("lr", [0.1], ["not a dotted config key"]),
    ("train.lr.x", [0.1], ["'train.lr.x' is not a config field (train.lr has no entries)"]),
    ("model.options.a.b", [1], ["not a dotted config key", "model.options.layers"]),
    ("train.global_batch_size", [64, "big"], ["must be of type int", "'big'"]),
    ("train.precision", ["fp32", "int4"], ["'int4', not one of fp32, bf16, fp16, fp8"]),
    ("train.global_batch_size", [], ["empty list"]),
    ("train.global_batch_size", "uniform(32, 256)", ["type int, so uniform(...)", "randint"]),
    ("train.lr", "randint(1, 5)", ["type float, so randint(...)"]),
    ("train.lr", "loguniform(0, 1e-3)", ["0 < a < b"]),
    ("train.lr", "uniform(1e-3, 1e-4)", ["a < b"]),
    ("train.lr", "normal(0, 1)", ["'normal(...)', which is not a distribution"]),
    ("train.precision", "choice([])", ["choice([a, b, ...])"]),
    ("train.lr", "uniform(1e-4, .inf)", ["finite a < b"]),
    ("train.lr", "loguniform(1e-4, inf)", ["finite 0 < a < b"]),
    ("train.warmup_steps", "randint(5, 5)", ["randint(5, 5)", "a < b"]),
])
def test_bad_space_entries_name_the_key_and_the_fix(path, raw, words):
    with pytest.raises(ConfigError) as e:
        parse_dim(path, raw)
    for word in words:
        assert word in str(e.value)
    assert "Fix:" in str(e.value)


@pytest.mark.parametrize("change, words", [
    ({"space": {}}, ["'space' is empty"]),
    ({"objective": "accuracy"}, ["'objective' is 'accuracy', not one of eval_loss, samples_per_s, time_to_target"]),
    ({"objective": "time_to_target"}, ["'target_loss' is missing"]),
    ({"target_loss": 1.5}, ["'target_loss' is set but the objective is samples_per_s"]),
    ({"objective": "time_to_target", "target_loss": 1.5, "target_metric": "eval_loss"}, ["train.eval_every is 0"]),
    ({"lr_scaling": "cubic"}, ["'lr_scaling' is 'cubic'"]),
    ({"spaces": {}}, ["'spaces' is not a sweep setting"]),
    ({"asha": {"grace": 3}}, ["'asha' is"]),
    ({"asha": {"reduction_factor": 1}}, ["'asha.reduction_factor' is 1", "must be >= 2"]),
    ({"asha": {"reduction_factor": -2}}, ["'asha.reduction_factor' is -2"]),
    ({"asha": {"grace_samples": 0}}, ["'asha.grace_samples' is 0, outside 1..51199"]),
    ({"asha": {"grace_samples": -64}}, ["'asha.grace_samples' is -64"]),
    ({"asha": {"grace_samples": 51200}}, ["'asha.grace_samples' is 51200, outside 1..51199", "default 6400"]),
    ({"asha": True, "sample_budget": 1}, ["'asha' is set but each trial sees only 1 sample"]),
    ({"objective": "time_to_target", "target_loss": float("nan")}, ["'target_loss' is nan", "finite"]),
    ({"objective": "time_to_target", "target_loss": "-inf"}, ["'target_loss' is -inf"]),
    ({"num_samples": 0}, ["'num_samples' is 0", ">= 1"]),
    ({"max_concurrent_trials": -1}, ["'max_concurrent_trials' is -1", ">= 0"]),
    ({"space": ["train.lr"]}, ["'space' is a list, not a mapping"]),
    ({"name": "../../etc"}, ["'name' is '../../etc'", "cannot name the sweep directory"]),
    ({"name": "a/b"}, ["'name' is 'a/b'"]),
    ({"base": {"train": {"max_step": 10}}}, ["'train.max_step' is not a config field"]),
    ({"sample_budget": 100, "space": {"train.max_steps": [10, 20]}}, ["sample_budget"]),
    # 48 is not a multiple of the micro-batch 32 once the sweep keeps the config's micro-batch
    ({"micro_batch": "config", "space": {"train.global_batch_size": [32, 48]}},
     ["invalid in trial {'train.global_batch_size': 48}", "not a multiple of train.micro_batch_size (32)"]),
])
def test_bad_sweeps_fail_before_any_trial(change, words):
    with pytest.raises(ConfigError) as e:
        parse_sweep(sweep(**change))
    for word in words:
        assert word in str(e.value)


def test_trial_config_applies_budget_lr_scaling_and_per_worker_micro_batch():
    spec = parse_sweep(sweep(lr_scaling="sqrt", base={"train": {"lr": 0.002, "max_steps": 100},
                                                      "scaling": {"min_workers": 2, "max_workers": 2}},
                             space={"train.global_batch_size": [64, 256]}))
    small, big = trial_config(spec, {"train.global_batch_size": 64}), trial_config(spec, {"train.global_batch_size": 256})
    assert (small.train.max_steps, big.train.max_steps) == (100, 25)          # same 6400 samples each
    assert small.train.lr == pytest.approx(0.002) and big.train.lr == pytest.approx(0.004)
    assert (small.train.micro_batch_size, big.train.micro_batch_size) == (32, 128)   # global / 2 workers
    linear = parse_sweep(sweep(lr_scaling="linear", base={"train": {"lr": 0.001}}))
    assert trial_tree(linear, {"train.global_batch_size": 32, "train.precision": "fp32"})["train"]["lr"] == 0.0005
    fixed = parse_sweep(sweep(micro_batch="config", sample_budget=640))
    assert trial_config(fixed, {"train.global_batch_size": 64, "train.precision": "bf16"}).train.max_steps == 10
    assert trial_config(fixed, {"train.global_batch_size": 64, "train.precision": "bf16"}).train.micro_batch_size == 32


def test_spec_round_trips_through_its_yaml_and_default_file_matches_code():
    spec = parse_sweep(sweep(space={"train.lr": "loguniform(1e-4, 3e-3)", "train.precision": "choice([fp32, bf16])",
                                    "train.global_batch_size": [32, 64]}, num_samples=3, asha=True))
    again = parse_sweep(yaml.safe_load(yaml.safe_dump(spec.to_dict())))
    assert again == spec and num_trials(spec) == 6
    from_file = parse_sweep(yaml.safe_load((ROOT / "jobs/configs/sweep-default.yaml").read_text()))
    assert from_file == parse_sweep(default_sweep(gpu=False))
    assert parse_sweep(default_sweep(gpu=True)).space["train.precision"].values == ("fp32", "bf16", "fp16")


def test_concurrency_fits_the_cluster_and_never_oversubscribes():
    spec = parse_sweep(sweep())                     # 1 worker, trained in the trial's own process: 1 CPU per trial
    assert max_concurrent(spec, {"CPU": 4}, use_gpu=False) == 4
    assert max_concurrent(spec, {"CPU": 7}, use_gpu=False) == 7
    assert max_concurrent(spec, {"CPU": 8, "GPU": 2}, use_gpu=True) == 2   # and its GPU, in that process too
    capped = parse_sweep(sweep(max_concurrent_trials=1))
    assert max_concurrent(capped, {"CPU": 16}, use_gpu=False) == 1
    two = parse_sweep(sweep(base={"scaling": {"min_workers": 2, "max_workers": 2}}))
    with pytest.raises(ConfigError, match="need 3 CPUs .* the cluster has 2"):
        max_concurrent(two, {"CPU": 2}, use_gpu=False)
    assert max_concurrent(two, {"CPU": 64, "GPU": 4}, use_gpu=True) == 2   # GPUs bound it: 2 per trial


def test_cli_bad_sweep_exits_2_before_ray_starts(tmp_path, capsys):
    import ray

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sweep(space={"train.global_batch_sise": [64]})))
    ray_was_up = ray.is_initialized()   # a session-wide Ray from another test may already be up
    assert main(["sweep", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "'train.global_batch_sise' is not a config field" in err and "global_batch_size" in err
    assert ray.is_initialized() == ray_was_up
    path.write_text(yaml.safe_dump(sweep(objective="time_to_target", target_loss=None)))
    assert main(["sweep", "--config", str(path)]) == 2
    assert main(["sweep", "--resume", str(tmp_path)]) == 2
    assert "is not a sweep directory" in capsys.readouterr().err
    assert ray.is_initialized() == ray_was_up


def test_asha_stops_on_samples_seen_so_batch_sizes_compare_fairly():
    from ray.tune.schedulers import ASHAScheduler

    from raydl.tune.sweep import _asha

    spec = parse_sweep(sweep(asha={"grace_samples": 1280, "reduction_factor": 3}, base={"train": {"max_steps": 100}}))
    asha = _asha(spec)
    assert isinstance(asha, ASHAScheduler) and asha._time_attr == "samples" and asha.metric == "loss"
    # max_t just below the budget: no rung where a trial has already seen all its samples
    assert asha._max_t == 6399 and asha._reduction_factor == 3 and not asha._stop_last_trials
    assert max(milestone for milestone, _ in asha._brackets[0]._rungs) < 6400
    with_eval = parse_sweep(sweep(asha=True, base={"train": {"eval_every": 20}}))
    assert _asha(with_eval).metric == "eval_loss" and _asha(parse_sweep(sweep())) is None
    assert with_eval.asha.grace(with_eval.budget()) == 51200 // 8   # default: 800 steps x 64


@pytest.mark.parametrize("asha", [{"reduction_factor": 2}, {"grace_samples": 1}, {"grace_samples": 6399}])
def test_every_asha_setting_parse_sweep_accepts_builds_the_scheduler(asha):
    from ray.tune.schedulers import ASHAScheduler

    from raydl.tune.sweep import _asha

    scheduler = _asha(parse_sweep(sweep(asha=asha, base={"train": {"max_steps": 100}})))   # ASHA asserts the rest
    assert isinstance(scheduler, ASHAScheduler)


def model_options_sweep(space: dict, **base) -> dict:
    return sweep(space={"train.global_batch_size": [32], **space}, base={"scaling": {"min_workers": 1, "max_workers": 1},
                                                                         **base})


def test_a_sweep_varies_model_options_and_each_trial_builds_its_own():
    spec = parse_sweep(model_options_sweep({"model.options.layers": [2, 4], "model.options.width": "choice([64, 96])"}))
    assert spec.space["model.options.layers"].values == (2, 4)
    trial = trial_config(spec, {"train.global_batch_size": 32, "model.options.layers": 4, "model.options.width": 96})
    assert trial.model.options == {"layers": 4, "width": 96}
    assert choose_model(trial.model).options.dims() == (4, 96, 4)   # the gpt preset's heads, the trial's depth and width
    assert parse_dim("model.options.layers", "randint(2, 5)").kind == "randint"
    hf = parse_sweep(model_options_sweep({"model.options.num_hidden_layers": [2, 3]}, model={"name": "hf"}))
    hf_trial = trial_config(hf, {"train.global_batch_size": 32, "model.options.num_hidden_layers": 3})
    assert choose_model(hf_trial.model).options.num_hidden_layers == 3


@pytest.mark.parametrize("space, base, words", [
    ({"model.options.layerz": [2, 4]}, {}, ["'model.options.layerz' is invalid in trial", "not an option of model 'gpt'",
                                            "layers"]),
    ({"model.options.layers": "uniform(2, 4)"}, {}, ["model.options.layers must be of type int, got 2.0"]),
    ({"model.options.layers": [2, "two"]}, {}, ["model.options.layers must be of type int, got 'two'"]),
    ({"model.options.num_hiden_layers": [2]}, {"model": {"name": "hf"}}, ["nor a field of transformers' LlamaConfig",
                                                                          "did you mean num_hidden_layers?"]),
])
def test_a_bad_model_option_in_the_space_fails_before_any_data_or_ray(tmp_path, space, base, words):
    spec = parse_sweep(model_options_sweep(space, data={"cache_dir": str(tmp_path / "cache")}, **base))
    with pytest.raises(ConfigError) as e:
        prepare_data(spec)
    for word in words:
        assert word in str(e.value)
    assert not (tmp_path / "cache").exists()   # refused before any dataset was generated


def test_cli_sweep_over_an_unknown_model_option_exits_2_before_ray_starts(tmp_path, capsys):
    import ray

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(model_options_sweep({"model.options.depth": [2, 4]})))
    ray_was_up = ray.is_initialized()
    assert main(["sweep", "--config", str(path)]) == 2
    assert "'model.options.depth' is invalid in trial" in capsys.readouterr().err
    assert ray.is_initialized() == ray_was_up
