"""What `raydl train` prints: by default raydl's own lines only (Ray's go to the run's ray.log), the layout once, and a
summary that records the start-up's phases in order; with --quiet only the summary JSON (and a user's model's own
prints on stderr)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.telemetry.startup import ORDER
from tests.helpers import not_raydls


def run_train(tmp_path: Path, data_cache: Path, *flags: str) -> str:
    """stdout and stderr of a 30-step default run, interleaved as a terminal shows them."""
    raydl = str(Path(sys.executable).parent / "raydl")
    sets = ["train.max_steps=30", "telemetry.report_every=10", f"data.cache_dir={data_cache}",
            "data.builtin_samples=4096", "train.eval_batches=2"]
    return subprocess.run([raydl, *flags, "train", *[a for s in sets for a in ("--set", s)]], cwd=tmp_path, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=600).stdout


@pytest.mark.slow
def test_default_run_console_is_quiet(data_cache, tmp_path):
    """docs/recovery.md's first command, `raydl train --set train.max_steps=30` (which marks it `tested by` this test),
    and the layout line that page shows it printing."""
    out = run_train(tmp_path, data_cache)
    lines = out.splitlines()
    raydl_lines = [line for line in lines if "[raydl]" in line]
    summary_lines = lines[lines.index("{"):] if "{" in lines else []
    others = [line for line in lines if line not in raydl_lines and line not in summary_lines]
    assert not any("PlacementGroupCleaner" in line or "PreemptionWatcher" in line for line in lines), out
    assert all(line.startswith("[raydl] ") for line in raydl_lines), raydl_lines   # no Ray prefix, no colour code
    assert sum("2 workers: data-parallel × 2 (torchft: " in line and ", from step 0, " in line   # survivors by default
               and line.endswith("a worker that dies: the others go on, its replacement copies a live peer (torchft)")
               for line in lines) == 1, out
    assert sum("[raydl] step " in line for line in lines) == 3 and summary_lines, out
    assert not others and not not_raydls(out), "\n".join(others)   # whole lines: pytest cuts a list's repr
    assert_startup_phases_in_order(json.loads("\n".join(summary_lines))["startup"])


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
    driver's console: tests/ray/test_s3_e2e.py, which json.loads stdout too.)"""
    source = (Path(__file__).parents[1] / "assets" / "own_net.py").read_text()
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "net.py").write_text(
        source.replace("        super().__init__()\n", f"        super().__init__()\n        {CHATTY}\n", 1))
    sets = ["model.name=mymodels.net:make_spec", f"data.cache_dir={data_cache}", "data.builtin_samples=4096",
            "train.max_steps=30", "telemetry.report_every=10", "checkpoint.every_steps=10", "train.eval_batches=1"]
    p = subprocess.run([str(Path(sys.executable).parent / "raydl"), "-q", "train",
                        *(a for s in sets for a in ("--set", s))], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads(p.stdout)
    assert summary["steps"] == 30 and Path(summary["checkpoint"]).is_dir()
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
    without Ray); the layout line is still a line, and stdout still carries only the summary."""
    bin_dir = Path(sys.executable).parent
    if launcher == "ray":   # the session's Ray: a private one is test_default_run_console_is_quiet's
        monkeypatch.setenv("RAY_ADDRESS", shared_ray_address)
    command = ([str(bin_dir / "raydl"), "train"] if launcher == "ray" else
               [sys.executable, "-m", "raydl.worker", "--set", "scaling.min_workers=1", "--set", "scaling.max_workers=1"])
    sets = ["train.max_steps=30", "telemetry.report_every=10", f"data.cache_dir={data_cache}",
            "data.builtin_samples=4096", "train.eval_batches=2"]
    stdout, terminal = run_with_terminal_stderr(tmp_path, [*command, *[a for s in sets for a in ("--set", s)]])
    lines = stdout.splitlines()
    assert json.loads("\n".join(lines[lines.index("{"):]))["steps"] == 30, stdout   # torchrun: a table before it
    assert "[raydl] step " not in terminal, terminal
    assert "train 100%|" in terminal and " 30/30 [" in terminal and " 10/30 [" in terminal, terminal
    assert " samples/s " in terminal and "core-h" in terminal, terminal
    assert sum("micro-batch" in line and "from step 0" in line for line in terminal.splitlines()) == 1, terminal
