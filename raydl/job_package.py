"""What a Ray job of raydl uploads and runs: the entry point, the working dir's package (secrets and
links leaving it refused or left out) and the job's runtime env. `raydl submit` uses it with `raydl.jobs`."""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from raydl.jobs import JobsError
from raydl.overrides import read_yaml

# Entry points that plain `ray job submit` can run too; they call the same CLI functions.
ENTRYPOINTS = {"train": "jobs/train.py", "sweep": "jobs/sweep.py"}
# Never uploaded, on top of .gitignore / .rayignore (Ray reads both): local state that is either big
# (.git, venvs, datasets, runs) or meaningless on the cluster.
DEFAULT_EXCLUDES = [".git", ".venv", "venv", "runs", ".raydl_data", "__pycache__", "*.pyc", ".pytest_cache",
                    "*.egg-info", ".mypy_cache", ".ruff_cache"]
# Secrets: anyone who can read the cluster's package store could read them. `*token*.py` is code (raydl's own
# data/tokenizer.py), so it stays; `.env*` comes after it so that a .env_token.py is still left out.
SECRET_EXCLUDES = [".ray", "*token*", "!*token*.py", ".env*", "*.pem", "*.key", ".netrc"]
LEFT_OUT_SHOWN = 5   # names printed in the one-line "left out of the upload" summary
# Local settings the job needs to behave like a local run (bf16 dies with SIGILL on CPUs that advertise AMX but trap it, without the ISA cap).
PASS_THROUGH_ENV = ("OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA")

# Ray's walk logs "Issue with path" when the handler raises; raydl's own error says it all.
_SILENT = logging.getLogger("raydl.jobs.package")
_SILENT.disabled = True
ZIP_ENTRY_OVERHEAD = 128   # bytes per file in Ray's uncompressed (ZIP_STORED) package, headers included


def entrypoint(command: list[str]) -> str:
    """`raydl submit -- train --config x.yaml` -> `python jobs/train.py --config x.yaml`."""
    if not command or command[0] not in ENTRYPOINTS:
        raise JobsError(f"nothing to submit after '--' (got {shlex.join(command) or 'nothing'}). Fix: "
                        f"`raydl submit ... -- {' | '.join(ENTRYPOINTS)} [--config FILE] [--set k=v ...]`")
    return shlex.join(["python", ENTRYPOINTS[command[0]], *command[1:]])


def check_working_dir(working_dir: Path, command: list[str]) -> None:
    """The job runs `python jobs/<cmd>.py` inside the uploaded copy: what it needs must be in it."""
    if not (working_dir / ENTRYPOINTS[command[0]]).is_file():
        raise JobsError(f"--working-dir {working_dir} has no {ENTRYPOINTS[command[0]]}: the job runs raydl's entry "
                        "point from the uploaded directory. Fix: run from the raydl checkout or pass "
                        "--working-dir path/to/raydl")
    for flag, value in zip(command, command[1:]):
        if flag == "--config" and not _inside(working_dir, value):
            raise JobsError(f"--config {value} is not a file inside --working-dir {working_dir}, so the job "
                            "would not find it. Fix: put the config in the working directory (e.g. jobs/configs/) "
                            "and give its path relative to it")


def check_model_uploaded(working_dir: Path, command: list[str], package: Package) -> None:
    """A model.name import path whose module is in the working dir: the job imports it from the upload."""
    for name in _model_names(working_dir, command):
        module, colon, _ = name.partition(":")
        found = [p for p in (f"{module.replace('.', '/')}.py", module.replace(".", "/")) if (working_dir / p).exists()]
        dropped = [out for p in found if colon for out in package.left_out if p == out or p.startswith(f"{out}/")]
        if dropped:
            raise JobsError(f"model.name {name} is defined in {found[0]}, which the upload leaves out ({dropped[0]}), "
                            f"so the job could not import it. Fix: --include {dropped[0]}, or take it out of "
                            ".gitignore/.rayignore/--exclude")


def _model_names(working_dir: Path, command: list[str]) -> list[str]:
    names = [v.partition("=")[2] for f, v in zip(command, command[1:]) if f == "--set" and v.startswith("model.name=")]
    for flag, value in zip(command, command[1:]):
        model = read_yaml(working_dir / value).get("model") if flag == "--config" else None
        if isinstance(model, dict):
            names.append(str(model.get("name", "")))
    return names


def _inside(working_dir: Path, path: str) -> bool:
    p = Path(path)
    full = (p if p.is_absolute() else working_dir / p).resolve()
    return full.is_file() and full.is_relative_to(working_dir.resolve())


@dataclass
class Package:
    """What `raydl submit` uploads: Ray's own walk, ignore files and excludes, as `create_package` zips it."""

    size: int = 0                  # bytes, an upper bound of the zip (ZIP_ENTRY_OVERHEAD per file)
    files: int = 0
    left_out: list[str] = field(default_factory=list)   # top-most paths the excludes and ignore files drop


def scan_package(working_dir: Path, excludes: list[str]) -> Package:
    """Walk the working dir exactly as Ray's zip does; refuse a symlink that would upload something outside it."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    root = working_dir.absolute()
    kept: list[Path] = []
    package = Package()

    def add(path: Path) -> None:
        _refuse_outside_link(path, root)
        kept.append(path)
        if path.is_file():
            package.size += path.stat().st_size + ZIP_ENTRY_OVERHEAD + len(str(path))
            package.files += 1

    _dir_travel(root, [_get_excludes(root, excludes)], add, include_gitignore=include_gitignore, logger=_SILENT)
    kept_set = set(kept)
    dropped = [child for d in kept if d.is_dir() for child in d.iterdir() if child not in kept_set]
    package.left_out = sorted((str(p.relative_to(root)) for p in dropped), key=lambda n: (n.count("/"), n))
    return package


def _refuse_outside_link(path: Path, root: Path) -> None:
    # Ray's zip follows links: a link to ~/.ssh would upload the keys, one to / the whole disk.
    if path.is_symlink() and path.exists() and not path.resolve().is_relative_to(root.resolve()):
        raise JobsError(f"--working-dir {root} holds the symlink {path.relative_to(root)} -> {path.resolve()}, which "
                        "leaves the working dir: Ray would upload what it points to. Fix: remove the link, copy what "
                        "the job needs into the working dir, or --exclude the link")


def check_package(working_dir: Path, excludes: list[str]) -> Package:
    """Fail before zipping/uploading when the package cannot fit into Ray's GCS store or would leak files."""
    from ray._private.runtime_env import packaging

    package = scan_package(working_dir, excludes)
    limit = packaging.GCS_STORAGE_MAX_SIZE
    if package.size >= limit:
        raise JobsError(f"--working-dir {working_dir} would upload {package.size / 2**20:.1f} MiB in {package.files} "
                        f"files, over Ray's limit of {limit / 2**20:.1f} MiB per package. Fix: list big files or "
                        "folders (datasets, checkpoints, outputs) in .rayignore or .gitignore there, or pass "
                        "--exclude; put data on shared storage (s3://, gs://, NFS) and point data.path at it")
    return package


def left_out_summary(package: Package) -> str:
    if not package.left_out:
        return "left out of the upload: nothing"
    names = package.left_out[:LEFT_OUT_SHOWN]
    more = ", ..." if len(package.left_out) > LEFT_OUT_SHOWN else ""
    return (f"left out of the upload: {len(package.left_out)} paths ({', '.join(names)}{more}); "
            "--include PATTERN uploads one anyway")


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASS_THROUGH_ENV if k in os.environ}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise JobsError(f"--env {pair!r} is not KEY=VALUE. Fix: e.g. --env OMP_NUM_THREADS=4")
        env[key] = value
    return env


def runtime_env(working_dir: Path, *, env: dict[str, str], excludes: list[str], pip: str | None,
                includes: list[str] = ()) -> dict:
    """--include re-admits what raydl leaves out by default (a gitignore `!pattern`); --exclude still wins."""
    patterns = DEFAULT_EXCLUDES + SECRET_EXCLUDES + [f"!{p}" for p in includes] + excludes
    renv = {"working_dir": str(working_dir), "excludes": patterns, "env_vars": env}
    if pip:
        if not Path(pip).is_file():
            raise JobsError(f"--pip {pip} is not a file. Fix: pass a requirements.txt path")
        renv["pip"] = pip   # Ray reads the file here and installs it on every node, cached per env
    return renv
