"""Bad config input through the real CLI: exit 2, one paragraph naming the field, no traceback, nothing written."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from raydl.cli import main


def tree_digest(root) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


# (--set value, the field the message must name)
BAD_VALUES = [
    ("train.lr=nan", "train.lr"), ("train.lr=inf", "train.lr"), ("train.lr=-1e-3", "train.lr"), ("train.lr=0", "train.lr"),
    ("train.beta1=1.0", "train.beta1"), ("train.beta2=-0.1", "train.beta2"), ("train.beta2=nan", "train.beta2"),
    ("train.weight_decay=-0.1", "train.weight_decay"), ("train.weight_decay=inf", "train.weight_decay"),
    ("train.grad_clip=-1", "train.grad_clip"), ("train.grad_clip=nan", "train.grad_clip"),
    ("train.momentum=1.5", "train.momentum"), ("train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("model.dropout=1.0", "model.dropout"), ("model.dropout=-0.5", "model.dropout"), ("model.dropout=nan", "model.dropout"),
    ("data.eval_fraction=0", "data.eval_fraction"), ("data.eval_fraction=1.5", "data.eval_fraction"),
    ("data.eval_fraction=nan", "data.eval_fraction"), ("scaling.cpus_per_worker=nan", "scaling.cpus_per_worker"),
    ("scaling.cpus_per_worker=-0.5", "scaling.cpus_per_worker"), ("scaling.cpus_per_worker=inf", "scaling.cpus_per_worker"),
    ("scaling.gpus_per_worker=-1", "scaling.gpus_per_worker"), ("data.read_cpus=nan", "data.read_cpus"),
    ("scaling.max_failures=-2", "scaling.max_failures"), ("scaling.resize_check_s=-1", "scaling.resize_check_s"),
    ("scaling.worker_start_timeout_s=0", "scaling.worker_start_timeout_s"), ("train.seed=-1", "train.seed"),
    ("parallel.stage_cuts=[1, 2", "parallel.stage_cuts"), ("train.lr={a: [", "train.lr"),
    ("data.shuffle=maybe", "data.shuffle"), ("train.max_steps=1e3", "train.max_steps"),
]


@pytest.mark.parametrize("assignment, field", BAD_VALUES, ids=[a for a, _ in BAD_VALUES])
def test_bad_value_exits_2_naming_the_field(assignment, field, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("untouched")
    before = tree_digest(tmp_path)
    assert main(["train", "--set", assignment]) == 2
    err = capsys.readouterr().err
    assert f"'{field}'" in err and "Fix:" in err and "Traceback" not in err
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_mistyped_field_is_refused_before_torch_or_ray_is_imported(command, tmp_path):
    """The driver's torch (~2 CPU-s) and the sweep's Ray Tune (~3 more) come after the config is checked: a typo's
    paragraph comes at once (0.2-0.4 CPU-s against 2.5 and 5.1 before, 2026-12-06)."""
    code = ("import sys; from raydl.cli import main; rc = main([sys.argv[1], '--set', 'train.max_stepz=10']); "
            "print('imported:', sorted(m for m in ('torch', 'ray') if m in sys.modules), file=sys.stderr); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, command], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2 and "'train.max_stepz' is not a config field" in done.stderr, done.stderr
    assert "imported: []" in done.stderr and list(tmp_path.iterdir()) == [], done.stderr


# (config file bytes, what the message must name)
BAD_FILES = [
    (b"train:\n  lr: \xff\xfe\n", "not UTF-8"),
    (b"- train\n- model\n", "not a mapping"),
    (b"1: {lr: 2}\n", "'1'"),
    (b"train: {1: 2}\n", "'train.1'"),
    (b"train: [1, 2\n", "not valid YAML"),
    (b"train: 3\n", "must be a mapping"),
    (b"train:\n  lr: .nan\n", "'train.lr'"),
    (b"train:\n  lr: [0.1]\n", "'train.lr'"),
    (b"scaling:\n  use_gpu: maybe\n", "'scaling.use_gpu'"),
]


@pytest.mark.parametrize("content, named", BAD_FILES, ids=[n for _, n in BAD_FILES])
def test_bad_config_file_exits_2(content, named, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_bytes(content)
    before = tree_digest(tmp_path)
    assert main(["train", "--config", "bad.yaml"]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and err.startswith("raydl: error:")
    assert tree_digest(tmp_path) == before
