"""raydl submit / raydl jobs without a cluster: token discovery, entry points, upload checks, bad input.

Everything that can be decided before talking to a job server is checked here; the real server is in
tests/ray/test_jobs_submit.py.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from ray._private.runtime_env.packaging import create_package

from raydl import jobs
from raydl.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No token or address from the developer's environment or home directory."""
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_token_precedence(clean_env, monkeypatch):
    home_token = clean_env / "home" / ".ray" / "auth_token"
    home_token.parent.mkdir(parents=True)
    home_token.write_text("from-home\n")
    assert jobs.find_token() == jobs.Token("from-home", str(home_token))
    path_token = clean_env / "path_token"
    path_token.write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path_token))
    assert jobs.find_token().value == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert jobs.find_token().value == "from-env"
    flag_token = clean_env / "flag_token"
    flag_token.write_text("  from-flag \n")
    assert jobs.find_token(str(flag_token)) == jobs.Token("from-flag", f"--token-file {flag_token}")


def test_no_token_anywhere(clean_env):
    token = jobs.find_token()
    assert token.value is None and "~/.ray/auth_token" in token.source


@pytest.mark.parametrize("content", [None, "  \n"])
def test_unreadable_or_empty_token_file(clean_env, capsys, content):
    path = clean_env / "tok"
    if content is not None:
        path.write_text(content)
    assert main(["jobs", "list", "--token-file", str(path), "--address", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "--token-file" in err and "ray get-auth-token" in err


def test_address_resolution(clean_env, monkeypatch):
    assert jobs.resolve_address(None) == jobs.DEFAULT_ADDRESS
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")   # a GCS address is not a job server: ignored
    assert jobs.resolve_address(None) == jobs.DEFAULT_ADDRESS
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.5:8265")
    assert jobs.resolve_address(None) == "http://10.0.0.5:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://10.0.0.6:8265")
    assert jobs.resolve_address(None) == "http://10.0.0.6:8265"
    assert jobs.resolve_address("10.0.0.7:8265") == "http://10.0.0.7:8265"   # --address wins, http by default


def test_entrypoints():
    assert jobs.entrypoint(["train", "--config", "a b.yaml"]) == "python jobs/train.py --config 'a b.yaml'"
    assert jobs.entrypoint(["sweep"]) == "python jobs/sweep.py"
    for bad in ([], ["bench"]):
        with pytest.raises(jobs.JobsError, match="train | sweep"):
            jobs.entrypoint(bad)


def test_env_pass_through(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert jobs.parse_env(["A=1", "B=x=y", "OMP_NUM_THREADS=4"]) == {"OMP_NUM_THREADS": "4", "A": "1", "B": "x=y"}
    assert jobs.parse_env([]) == {"OMP_NUM_THREADS": "3"}
    with pytest.raises(jobs.JobsError, match="KEY=VALUE"):
        jobs.parse_env(["NOVALUE"])


def test_unreachable_address_exit_2(clean_env, capsys):
    with socket.socket() as s:   # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["jobs", "status", "raysubmit_x", "--address", f"http://127.0.0.1:{port}"]) == 2
    assert f"cannot reach the Ray job server at http://127.0.0.1:{port}" in capsys.readouterr().err


def test_submit_checks_working_dir_and_config(tmp_path, capsys):
    assert main(["submit", "--working-dir", str(tmp_path), "--", "train"]) == 2
    assert "has no jobs/train.py" in capsys.readouterr().err
    outside = tmp_path / "my.yaml"
    outside.write_text("train: {max_steps: 1}\n")
    assert main(["submit", "--working-dir", str(REPO), "--", "train", "--config", str(outside)]) == 2
    assert f"--config {outside} is not a file inside --working-dir" in capsys.readouterr().err
    assert main(["submit", "--working-dir", str(REPO), "--"]) == 2
    assert "nothing to submit" in capsys.readouterr().err


def _mini_checkout(root: Path) -> Path:
    (root / "jobs").mkdir(parents=True)
    (root / "jobs" / "train.py").write_text("print('hi')\n")
    return root


def test_package_size_follows_ray_ignore_rules(tmp_path):
    wd = _mini_checkout(tmp_path / "wd")
    base, _ = jobs.package_size(wd, jobs.DEFAULT_EXCLUDES)
    for name in ("runs/big.bin", ".git/objects/pack.bin", "ignored/big.bin", "rayignored.bin", "kept.bin"):
        (wd / name).parent.mkdir(parents=True, exist_ok=True)
        (wd / name).write_bytes(b"x" * 100_000)
    (wd / ".gitignore").write_text("ignored/\n")
    (wd / ".rayignore").write_text("rayignored.bin\n")
    size, files = jobs.package_size(wd, jobs.DEFAULT_EXCLUDES)
    # only kept.bin and the two ignore files are new (each file also costs a zip header)
    assert files == 4 and 100_000 < size - base < 101_000
    # The estimate is an upper bound of the zip Ray itself builds from the same directory.
    zip_path = tmp_path / "pkg.zip"
    create_package(str(wd), zip_path, include_gitignore=True, excludes=jobs.DEFAULT_EXCLUDES)
    assert 0 <= size - zip_path.stat().st_size < files * jobs.ZIP_ENTRY_OVERHEAD + 1000


def test_working_dir_over_ray_limit_exit_2(tmp_path, monkeypatch, capsys):
    from ray._private.runtime_env import packaging

    wd = _mini_checkout(tmp_path / "wd")
    (wd / "data.bin").write_bytes(b"x" * 300_000)
    monkeypatch.setattr(packaging, "GCS_STORAGE_MAX_SIZE", 256 * 1024)   # Ray's real limit is 512 MiB
    # Checked before any connection: the address is never contacted.
    assert main(["submit", "--address", "http://127.0.0.1:1", "--working-dir", str(wd), "--", "train"]) == 2
    err = capsys.readouterr().err
    assert "would upload 0.3 MiB in 2 files, over Ray's limit of 0.2 MiB" in err and ".rayignore" in err


def test_job_entry_adds_address_only_where_the_command_takes_it(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "jobs"))
    from _entry import _accepts_address

    from raydl.cli import build_parser

    parser = build_parser()
    assert _accepts_address(parser, "train") and not _accepts_address(parser, "config")
    assert not _accepts_address(parser, "no-such-command")
