"""raydl.train / raydl.sweep take a path, a dict or a JobConfig, and raise raydl's errors (no exit,
no traceback print) before Ray starts and before anything is written."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import raydl
from raydl.config import JobConfig


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ray_was_up = _ray_up()   # a slow test before this one in the same session may have started it
    yield tmp_path
    assert not (tmp_path / "runs").exists() and _ray_up() == ray_was_up


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _spec(**fields) -> raydl.ModelSpec:
    return raydl.ModelSpec(name="api_net", build=lambda options, meta: nn.Linear(4, 2), loss=F.mse_loss,
                           inputs_targets=lambda b: (b["x"], b["y"]), example_inputs=lambda meta, n: torch.randn(n, 4),
                           **fields)


@pytest.mark.parametrize("config, overrides, field", [
    ({"train": {"lr": "fast"}}, (), "train.lr"),
    ({"trian": {}}, (), "trian"),
    (JobConfig(), ["train.foo=1"], "train.foo"),
    (JobConfig(), {"train.max_steps": 0}, "train.max_steps"),
    (None, ["model.options.layers=two"], "model.options.layers"),
    ("missing.yaml", (), "--config"),
    (42, (), "config"),
    (None, "train.lr=1", "overrides"),
])
def test_train_raises_config_error_naming_the_field(config, overrides, field):
    with pytest.raises(raydl.ConfigError) as e:
        raydl.train(config, overrides=overrides)
    assert f"'{field}'" in str(e.value)


def test_yaml_path_is_read(in_tmp):
    (in_tmp / "c.yaml").write_text("train:\n  precision: fp8\n")
    with pytest.raises(raydl.ConfigError, match="'train.precision' is 'fp8'"):
        raydl.train("c.yaml")


def test_model_object_replaces_model_name_and_is_checked():
    with pytest.raises(raydl.ConfigError, match="'model' is a str, not a raydl.ModelSpec"):
        raydl.train(model="gpt")
    # The spec object is what runs: model.name=nonsense is never resolved; its missing task is the error.
    with pytest.raises(raydl.ConfigError, match="'data.path' is 'builtin', but model 'api_net' names no task"):
        raydl.train(overrides=["model.name=nonsense"], model=_spec())
    with pytest.raises(raydl.DataError, match="data.path '/nonexistent' does not exist"):
        raydl.train({"data": {"path": "/nonexistent"}}, model=_spec())


def test_sweep_raises_before_ray_starts():
    with pytest.raises(raydl.ConfigError, match="'--resume' is given with a sweep config"):
        raydl.sweep({"space": {}}, resume="somewhere")
    with pytest.raises(raydl.ConfigError, match="'train.foo'"):
        raydl.sweep(overrides=["train.foo=1"])
    with pytest.raises(raydl.ConfigError, match="'model' is a int"):
        raydl.sweep(model=3)


@pytest.mark.parametrize(("given", "env", "joined"), [
    (None, None, None),                                  # a private local Ray
    (None, "10.0.0.5:6379", "10.0.0.5:6379"),            # RAY_ADDRESS names a cluster, as ray.init reads it
    (None, "auto", "auto"),                              # what `ray job submit` sets for its entrypoint
    (None, "http://10.0.0.5:8265", None),                # a job server's: raydl submit's, not a driver's
    ("ray://head:10001", "10.0.0.5:6379", "ray://head:10001"),   # --address wins
])
def test_the_cluster_a_run_joins(given, env, joined, monkeypatch):
    from raydl.driver.ray_trainer import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if env:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert cluster_address(given) == joined
