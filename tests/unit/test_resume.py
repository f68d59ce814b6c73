"""--resume RUN: the run's config.yaml is the base, --config/--set on top, each change named; a change the checkpoint
cannot take refused before Ray starts, naming the field (raydl.driver.resume). No processes: a real run directory
(prepare_run), a real checkpoint, a bucket on fsspec's memory://."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import pytest
import torch

from raydl import commands
from raydl.cli import main as cli_main
from raydl.driver import resume
from raydl.driver.prepare import prepare_run
from raydl.driver.run_location import checkpoints_location
from raydl.errors import CheckpointError, ConfigError
from raydl.models.build import SkipWeightInit
from raydl.models.choice import choose_model
from raydl.models.gpt import build_gpt
from raydl.overrides import apply_overrides, build_config, dump_yaml, load_config
from raydl.train import checkpoint as ckpt
from tests.unit.test_checkpoint_safety import tiny_state

FP = {"name": "gpt", "size": "tiny", "params": 100, "blocks": 2}
DATASET = {"path": "/data/a", "manifest_sha256": "a" * 64, "tokenizer": "bpe-1"}


def record(tree=None, dataset=DATASET) -> resume.RunRecord:
    return resume.RunRecord("runs/old", tree or {"data": {"path": "/data/a"}}, dataset)


def fingerprint(cfg) -> dict:
    chosen = choose_model(cfg.model)
    with torch.device("meta"), SkipWeightInit():
        return chosen.fingerprint(chosen.build(chosen.open_dataset(cfg).meta))


@pytest.fixture(scope="module")
def old_run(tmp_path_factory, data_cache):
    """A run started with --set model.options.width=48 that saved a checkpoint at step 10 (read only)."""
    root = tmp_path_factory.mktemp("resume")
    cfg = load_config(None, [f"data.cache_dir={data_cache}", f"run.runs_dir={root / 'runs'}", "train.max_steps=20",
                             "data.builtin_samples=4096", "model.options.width=48", f"run.dir={root / 'old'}"])
    run = prepare_run(cfg, run_dir=root / "old")
    torch.manual_seed(0)
    model = build_gpt("tiny", vocab_size=16, seq_len=8)
    ckpt.save(run.run_dir / "train" / ckpt.checkpoint_name(10), model, torch.optim.AdamW(model.parameters()),
              {**tiny_state(10), "model": fingerprint(cfg)}, rank=0)
    return run.run_dir


def test_config_diff_names_each_changed_field_and_its_entries():
    before = {"train": {"lr": 0.001, "max_steps": 20}, "model": {"options": {"width": 48}}, "run": {"dir": "a"}}
    after = {"train": {"lr": 0.001, "max_steps": 40}, "model": {"options": {"width": 48, "layers": 3}},
             "run": {"dir": ""}}
    diff = resume.config_diff(before, after)
    assert diff == [("model.options.layers", None, 3), ("train.max_steps", 20, 40)]
    line = resume.diff_line(record(), diff)
    assert "\n" not in line and "2 field(s) changed" in line
    assert "model.options.layers None -> 3" in line and "train.max_steps 20 -> 40" in line
    assert "unchanged" in resume.diff_line(record(), [])


def test_the_runs_config_is_the_base_and_the_users_config_and_sets_go_on_top(old_run):
    tree = resume.resumed_tree(str(old_run), {"train": {"lr": 0.01}})
    cfg = build_config(apply_overrides(tree, ["train.max_steps=30"]))
    assert cfg.model.options == {"width": 48}                          # the run's --set, not the default
    assert (cfg.train.lr, cfg.train.max_steps) == (0.01, 30)           # the user's --config, then --set
    assert cfg.run.dir == ""                                           # a new run directory
    assert cfg.data.cache_dir == load_config(str(old_run / "config.yaml")).data.cache_dir


def test_a_resume_as_printed_prepares_and_names_what_changed(old_run, tmp_path, caplog):
    argv = shlex.split(commands.resume_run(old_run))
    assert argv == ["raydl", "train", "--resume", str(old_run)]
    cfg = build_config(apply_overrides(resume.resumed_tree(argv[-1], {}), ["train.max_steps=40"]))
    with caplog.at_level(logging.INFO, logger="raydl.driver.prepare"):
        run = prepare_run(cfg, resume=argv[-1], run_dir=tmp_path / "new")
    assert run.job["resume_from"] == str(old_run / "train" / ckpt.checkpoint_name(10))
    [line] = [r.getMessage() for r in caplog.records if "resuming the run of" in r.getMessage()]
    assert "1 field(s) changed: train.max_steps 20 -> 40" in line
    assert json.loads((run.run_dir / resume.DATASET_FILE).read_text()) == \
        json.loads((old_run / resume.DATASET_FILE).read_text())


def test_cli_refuses_a_model_shape_change_naming_the_field_before_ray(old_run, capsys, monkeypatch):
    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a resume that should have been refused")

    monkeypatch.setattr("raydl.driver.ray_trainer.connect", no_ray)
    assert cli_main(["train", "--resume", str(old_run), "--set", "model.options.width=64"]) == 2
    err = capsys.readouterr().err
    [paragraph] = [line for line in err.splitlines() if line.startswith("raydl: error:")]
    assert "config field 'model.options.width'" in paragraph and "64 (the run's: 48)" in paragraph
    assert "Fix:" in paragraph and "Traceback" not in err
    assert not (old_run.parent / "runs").exists()   # refused before a run directory was made (the run's runs_dir)


def test_cli_refuses_another_dataset_naming_the_field(old_run, capsys, monkeypatch):
    monkeypatch.setattr("raydl.driver.ray_trainer.connect", lambda *a, **k: pytest.fail("Ray started"))
    assert cli_main(["train", "--resume", str(old_run), "--set", "data.builtin_samples=2048"]) == 2
    err = capsys.readouterr().err
    assert "config field 'data.builtin_samples'" in err and "manifest.json's sha256" in err, err


def test_model_change_refusal_names_the_changed_fields():
    diff = [("model.options.width", 48, 64), ("train.lr", 0.1, 0.2)]
    error = resume.refusal(record(), diff, checkpoint="c", saved_model=FP, built_model={**FP, "params": 200},
                           dataset=DATASET)
    assert isinstance(error, ConfigError) and error.path == "model.options.width"
    assert "train.lr" not in str(error) and "'params': 200" in str(error)


def test_a_checkpoint_without_its_runs_record_says_it_needs_the_config():
    error = resume.refusal(None, [], checkpoint="s3://b/ckpt/step_00000010", saved_model=FP,
                           built_model={**FP, "params": 200}, dataset=DATASET)
    assert isinstance(error, CheckpointError) and "--config RUN_DIR/config.yaml" in str(error)
    assert "no run record" in str(error)


def test_dataset_content_decides_not_its_path():
    moved = {**DATASET, "path": "s3://bucket/a"}   # the same manifest, copied to a bucket
    assert resume.refusal(record(), [("data.path", "/data/a", "s3://bucket/a")], checkpoint="c", saved_model=FP,
                          built_model=FP, dataset=moved) is None
    other = {**DATASET, "manifest_sha256": "b" * 64}
    error = resume.refusal(record(), [], checkpoint="c", saved_model=FP, built_model=FP, dataset=other)
    assert isinstance(error, ConfigError) and error.path == "data.path" and "aaaaaaaaaaaa" in str(error)
    retokenized = {**other, "tokenizer": "bpe-2"}
    error = resume.refusal(record(), [], checkpoint="c", saved_model=FP, built_model=FP, dataset=retokenized)
    assert "its tokenizer is 'bpe-2', the run's 'bpe-1'" in str(error)
    assert resume.refusal(record(dataset=None), [], checkpoint="c", saved_model=FP, built_model=FP,
                          dataset=other) is None   # a run from before dataset.json: its model check still holds


def test_the_runs_record_is_found_from_its_checkpoints(old_run, tmp_path):
    step = old_run / "train" / ckpt.checkpoint_name(10)
    for path in (old_run, step):
        found = resume.find_run(str(path))
        assert found.where == str(old_run) and found.tree["model"]["options"] == {"width": 48}
    (tmp_path / "loose" / "step_00000010").mkdir(parents=True)
    assert resume.find_run(str(tmp_path / "loose" / "step_00000010")) is None


def test_a_run_mirrored_to_a_bucket_resumes_from_its_record(old_run):
    import fsspec

    fs = fsspec.filesystem("memory")
    mirror = "memory://bucket/ckpt/old-abc/run"
    for name in ("config.yaml", resume.DATASET_FILE):
        fs.pipe(f"/bucket/ckpt/old-abc/run/{name}", (old_run / name).read_bytes())
    fs.pipe("/bucket/ckpt/old-abc/step_00000010/raydl_state.json", b"{}")
    try:
        for path in (mirror, "memory://bucket/ckpt/old-abc", "memory://bucket/ckpt/old-abc/step_00000010"):
            found = resume.find_run(path)
            assert found.where == mirror and found.dataset == json.loads((old_run / resume.DATASET_FILE).read_text())
        assert checkpoints_location(mirror) == "memory://bucket/ckpt/old-abc"   # the checkpoints beside it
        assert dump_yaml(build_config(resume.resumed_tree(mirror, {}))) == \
            dump_yaml(build_config(resume.base_tree(resume.find_run(str(old_run)))))
    finally:
        fs.rm("/bucket", recursive=True)


def test_printed_commands_survive_the_shell():
    path = "/tmp/my runs/it's"
    assert shlex.split(commands.resume_run(path)) == ["raydl", "train", "--resume", path]
    assert shlex.split(commands.resume_sweep(path)) == ["raydl", "sweep", "--resume", path]
    connection = commands.connection_args("http://127.0.0.1:8265", "tok en", None, False)
    assert shlex.split(commands.job_logs("raysubmit_1", connection))[-4:] == \
        ["--address", "http://127.0.0.1:8265", "--token-file", str(Path("tok en").resolve())]


def test_a_model_that_changed_under_the_same_config_is_named_as_such():
    error = resume.refusal(record(), [("train.lr", 0.1, 0.2)], checkpoint="c", saved_model=FP,
                           built_model={**FP, "params": 200}, dataset=DATASET)
    assert isinstance(error, CheckpointError) and "the model's code changed since" in str(error)
