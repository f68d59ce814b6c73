"""What `raydl train` prints: by default raydl's own lines only (Ray's go to the run's ray.log), the layout once, and a
summary that records the start-up's phases in order; with --quiet only the summary JSON (and a user's model's own
prints on stderr)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.overrides import build_config
from raydl.telemetry.startup import ORDER
from tests.docs_run import blocks_tested_by, checkout_like, run_blocks
from tests.docs_run import run as run_as_documented
from tests.helpers import not_raydls
from tests.ray.test_own_model import loss_fell, losses_of


SURVIVORS_PATH = "a worker that dies: the others go on, its replacement copies a live peer (torchft)"


def documented_command(page: str, test: str) -> str:
    """The one command of `page`'s block marked `tested by` `test`: the page's own, by construction."""
    [command] = [c for block in blocks_tested_by(page, test) for c in block.commands]
    return command


@pytest.mark.slow
def test_default_run_console_is_quiet(data_cache, tmp_path):
    """README.md's own-model command (which marks it `tested by` this test), run as test_docs runs a page's commands:
    in a directory like the checkout, stdout and stderr interleaved as a terminal shows them, and on a private Ray,
    the path of a first `raydl train`."""
    command = documented_command("README.md", "tests/ray/test_console.py::test_default_run_console_is_quiet")
    done = run_as_documented(command, checkout_like(tmp_path, data_cache), ray_address=None)
    out = done.stdout
    assert done.returncode == 0, out[-4000:]
    lines = out.splitlines()
    raydl_lines = [line for line in lines if "[raydl]" in line]
    summary_lines = lines[lines.index("{"):] if "{" in lines else []
    others = [line for line in lines if line not in raydl_lines and line not in summary_lines]
    assert not any("PlacementGroupCleaner" in line or "PreemptionWatcher" in line for line in lines), out
    assert all(line.startswith("[raydl] ") for line in raydl_lines), raydl_lines   # no Ray prefix, no colour code
    assert sum("2 workers: data-parallel × 2 (torchft: " in line and ", from step 0, " in line   # survivors by default
               and line.endswith(SURVIVORS_PATH) for line in lines) == 1, out
    summary = json.loads("\n".join(summary_lines)) if summary_lines else {}
    max_steps = int(re.search(r"train\.max_steps=(\d+)", command)[1])
    assert summary_lines and summary["steps"] == max_steps, out
    assert sum("[raydl] step " in line for line in lines) == max_steps // build_config({}).telemetry.report_every, out
    assert not others and not not_raydls(out), "\n".join(others)   # whole lines: pytest cuts a list's repr
    assert_startup_phases_in_order(summary["startup"])


def assert_startup_phases_in_order(startup: dict) -> None:
    """The summary records the run's start-up: every phase, in the order they happen (the same default run as
    above: a private Ray, its start among the phases)."""
    at = startup["at_s"]
    # every mark, the driver's and the workers', but `compiled`: CPU workers run eager under train.compile=auto
    assert list(at) == [m for m in ORDER if m != "compiled"], at
    assert list(at.values()) == sorted(at.values()), at      # in the order they happen
    assert at["command_start"] == 0 and at["first_step"] == max(at.values()) == startup["to_first_step_s"]
    assert at["prepared"] > 0.1, at   # from the process's creation: the interpreter and imports count
    assert all(seconds >= 0 for seconds in startup["phase_s"].values()), startup


CHATTY = "print('[mymodels.net] Net built')   # like nanoGPT's parameter count"


@pytest.mark.slow
def test_quiet_run_of_a_model_that_prints_leaves_stdout_to_the_summary(data_cache, tmp_path, on_shared_ray):
    """`raydl -q train` of a user model that prints when it is built (in the driver, and in every Ray worker, whose
    lines Ray forwards to the driver): stdout is the summary JSON alone; stderr holds the driver's own print and
    nothing else, no raydl line, not even Ray's connection lines; the workers' prints are in the run's ray.log
    (raydl.driver.ray_output). On the session's Ray (a private Ray's token-auth warning is
    test_default_run_console_is_quiet's), which as a single-node cluster takes the default, local checkpoint storage
    (raydl refuses it only on clusters of several nodes). (A worker SIGKILLed mid-run, whose death Ray reports on the
    driver's console: tests/ray/test_s3_e2e.py, which json.loads stdout too.) The model, named by import path from
    the working directory, trains in a pipeline (pp=2) and learns."""
    source = (Path(__file__).parents[1] / "assets" / "own_net.py").read_text()
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "net.py").write_text(
        source.replace("        super().__init__()\n", f"        super().__init__()\n        {CHATTY}\n", 1))
    # 80 steps: over 40 the loss fell 12-15% depending on the epoch's order, at the edge of loss_fell's 15%
    sets = ["model.name=mymodels.net:make_spec", "model.options.hidden=64", "parallel.pp_degree=2",
            f"data.cache_dir={data_cache}", "data.builtin_samples=4096", "train.max_steps=80", "train.warmup_steps=5",
            "train.lr=0.003", "telemetry.report_every=10", "checkpoint.every_steps=40", "train.eval_batches=1"]
    p = subprocess.run([str(Path(sys.executable).parent / "raydl"), "-q", "train",
                        *(a for s in sets for a in ("--set", s))], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads(p.stdout)
    assert summary["steps"] == 80 and Path(summary["checkpoint"]).is_dir()
    assert summary["layouts"][0]["pp"] == 2, summary["layouts"]
    assert loss_fell(losses_of(summary["run_dir"])), losses_of(summary["run_dir"])
    saved = json.loads((Path(summary["checkpoint"]) / "raydl_state.json").read_text())["model"]
    assert saved["name"] == "own_net" and saved["blocks"] == 2, saved
    assert Path(summary["checkpoint"]).resolve().is_relative_to((tmp_path / "runs").resolve()), summary   # local
    assert p.stdout.startswith("{"), p.stdout
    built = [line for line in p.stderr.splitlines() if "[mymodels.net] Net built" in line]
    assert built and all("pid=" not in line for line in built), built   # the driver's own print
    assert p.stderr.splitlines() == built, p.stderr   # no raydl line, no Ray line
    ray_log = (Path(summary["run_dir"]) / "ray.log").read_text()     # the workers' prints: off the console
    assert "(RayTrainWorker pid=" in ray_log and "[mymodels.net] Net built" in ray_log, ray_log[-4000:]


def run_with_terminal_stderr(tmp_path: Path, command: list[str]) -> tuple[str, str]:
    """stdout (a pipe) and stderr (a pseudo-terminal, as in an interactive shell) of `command`."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))   # rows, columns: a real terminal's
    proc = subprocess.Popen(command, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=slave,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(slave)
    chunks: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:   # EIO: every writer of the terminal has exited
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    stdout, _ = proc.communicate(timeout=600)
    reader.join(timeout=30)
    os.close(master)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return stdout, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["ray", "torchrun"])
def test_a_terminal_shows_one_progress_bar(data_cache, tmp_path, launcher, shared_ray_address, monkeypatch):
    """On a terminal the progress lines become one tqdm bar (driven by the driver's relay under Ray, by rank 0
    without Ray); the layout line is still a line, and stdout still carries only the summary. Under Ray it is
    docs/recovery.md's first command (which marks it `tested by` this test) as test_docs runs a guide's, on the
    session's Ray, and its layout line ends with the path a worker's death takes, as that page shows. It is
    docs/train.md's first command too (one run for both pages), whose next block then reads what the run wrote."""
    test = "tests/ray/test_console.py::test_a_terminal_shows_one_progress_bar"
    if launcher == "ray":
        monkeypatch.setenv("RAY_ADDRESS", shared_ray_address)
        monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        cwd = checkout_like(tmp_path, data_cache)
        first, *train_md_after = blocks_tested_by("docs/train.md", test)
        assert list(first.commands) == [documented_command("docs/recovery.md", test)], first.commands
        command = ["bash", "-c", *first.commands]
    else:
        cwd = tmp_path
        sets = ["scaling.min_workers=1", "scaling.max_workers=1", "train.max_steps=30", "telemetry.report_every=10",
                f"data.cache_dir={data_cache}", "data.builtin_samples=4096", "train.eval_batches=2"]
        command = [sys.executable, "-m", "raydl.worker", *[a for s in sets for a in ("--set", s)]]
    stdout, terminal = run_with_terminal_stderr(cwd, command)
    lines = stdout.splitlines()
    assert json.loads("\n".join(lines[lines.index("{"):]))["steps"] == 30, stdout   # torchrun: a table before it
    assert "[raydl] step " not in terminal, terminal
    assert "train 100%|" in terminal and " 30/30 [" in terminal and " 10/30 [" in terminal, terminal
    assert " samples/s " in terminal and "core-h" in terminal, terminal
    layout = [line for line in terminal.splitlines() if "micro-batch" in line and "from step 0" in line]
    assert len(layout) == 1, terminal
    assert launcher == "torchrun" or layout[0].rstrip().endswith(SURVIVORS_PATH), layout
    if launcher == "ray":
        run_blocks(train_md_after, cwd, shared_ray_address)
