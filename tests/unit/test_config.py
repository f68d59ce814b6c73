"""Config: strict loading, every bad input gives one clear error and exit code 2, nothing written."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from raydl.cli import main
from raydl.config import JobConfig, iter_fields
from raydl.errors import ConfigError, LayoutError
from raydl.overrides import build_config, dump_yaml, load_config
from raydl.parallel.mesh import layout_for


def test_yaml_and_overrides_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 3e-4\n  precision: bf16\nscaling:\n  max_workers: 8\nparallel:\n  stage_cuts: [2, 4]\n")
    cfg = load_config(path, ["train.lr=1e-2", "scaling.use_gpu=false", "parallel.pp_degree=auto"])
    assert (cfg.train.lr, cfg.train.precision, cfg.scaling.max_workers) == (1e-2, "bf16", 8)
    assert cfg.parallel.pp_degree == "auto" and cfg.parallel.stage_cuts == [2, 4]
    again = tmp_path / "again.yaml"
    again.write_text(dump_yaml(cfg))
    assert load_config(again) == cfg
    assert build_config(cfg.to_dict()) == cfg


@pytest.mark.parametrize("override, field", [
    (["train.foo=1"], "train.foo"),
    (["trian.lr=1"], "trian"),
    (["train.lr=fast"], "train.lr"),
    (["train.max_steps=1.5"], "train.max_steps"),
    (["train.global_batch_size=0"], "train.global_batch_size"),
    (["train.micro_batch_size=-4"], "train.micro_batch_size"),
    (["train.global_batch_size=30"], "train.global_batch_size"),
    (["train.precision=int4"], "train.precision"),
    (["scaling.min_workers=4", "scaling.max_workers=2"], "scaling.min_workers"),
    (["parallel.pp_degree=0"], "parallel.pp_degree"),
    (["train.max_steps=0"], "train.max_steps"),
    (["data.backend=ray", "data.max_bad_shards=2"], "data.max_bad_shards"),
    (["data.read_cpus=-1"], "data.read_cpus"),
    (["notakey"], "notakey"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    assert f"'{field}'" in str(e.value) and "Fix:" in str(e.value)


def test_missing_and_invalid_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    wrong_shape = tmp_path / "shape.yaml"
    wrong_shape.write_text("train: 3\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(wrong_shape)


def test_global_batch_must_split_over_a_fixed_world():
    cfg = load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=32",
                             "scaling.min_workers=3", "scaling.max_workers=3"])
    with pytest.raises(LayoutError, match="cannot be split exactly over 3"):
        layout_for(cfg, 3, num_blocks=6)


def test_elastic_world_keeps_global_batch_or_warns():
    cfg = load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=16",
                             "scaling.min_workers=1", "scaling.max_workers=4"])
    for ws in (1, 2, 4):
        layout = layout_for(cfg, ws, num_blocks=6)
        assert layout.global_batch == 64 and layout.micro_batch <= 16
    with pytest.warns(UserWarning, match="global batch of 63"):
        assert layout_for(cfg, 3, num_blocks=6).global_batch == 63


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    missing = [f"{s}.{f.name}" for s, f in iter_fields() if f"{s}.{f.name}" not in out]
    assert not missing


def test_every_field_is_documented():
    assert all(f.metadata.get("help") for _, f in iter_fields())


@pytest.mark.parametrize("argv", [
    ["train", "--set", "train.foo=1"],
    ["train", "--set", "train.precision=fp64"],
    ["train", "--config", "/nonexistent.yaml"],
    ["train", "--resume", "/nonexistent/run"],
    ["config", "show", "--set", "scaling.min_workers=9"],
])
def test_cli_bad_input_exits_2_and_writes_nothing(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydl: error:") and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_config_show_prints_effective_config(capsys):
    assert main(["config", "show", "--set", "train.lr=0.5"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["lr"] == 0.5
    assert set(shown) == {f.name for f in dataclasses.fields(JobConfig)}
