"""Shared start-up of the job entry points (`python jobs/train.py ...` inside a Ray job, or locally)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(command: str, argv: list[str]) -> int:
    # `python jobs/x.py` puts jobs/ on sys.path, not the checkout: import the raydl next to this file
    # (the uploaded working dir inside a Ray job), even where raydl is not installed.
    sys.path.insert(0, str(ROOT))
    import raydl
    from raydl.cli import build_parser, main as cli_main

    in_job = bool(os.environ.get("RAY_ADDRESS"))   # the job supervisor sets it for the driver
    if in_job:
        # The job's runtime_env (working_dir, env_vars) and raydl's ray.init(runtime_env=...) may name the same
        # env var (e.g. OMP_NUM_THREADS); Ray refuses to merge such envs unless told the driver's value wins.
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        if "--address" not in argv and _accepts_address(build_parser(), command):
            argv = [*argv, "--address", "auto"]
    print(f"[raydl] job entry: raydl {command} from {Path(raydl.__file__).parent}, ray address "
          f"{os.environ.get('RAY_ADDRESS') or 'local (none set)'}", flush=True)
    return cli_main([command, *argv])


def _accepts_address(parser, command: str) -> bool:
    """Whether `raydl <command>` has an --address option (argparse keeps subcommands in private fields)."""
    for action in parser._actions:
        if action.choices and command in action.choices:
            return "--address" in action.choices[command]._option_string_actions
    return False   # no such command installed: let the CLI itself report it
