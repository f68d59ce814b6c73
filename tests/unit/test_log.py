"""The one "raydl" logger: levels per verbosity, the [raydl] look on stderr, -q/-v on the real CLI, and the
verbosity reaching a worker process through RAYDL_VERBOSITY."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from raydl import log

RAYDL = str(Path(sys.executable).parent / "raydl")


@pytest.fixture(autouse=True)
def restore_logger(monkeypatch):
    """configure() changes a process-wide logger and RAYDL_VERBOSITY: put both back for the tests after."""
    monkeypatch.delenv(log.VERBOSITY_ENV, raising=False)
    saved = log.logger.handlers[:], log.logger.level, log.logger.propagate
    yield
    log.logger.handlers[:], log.logger.level, log.logger.propagate = saved


@pytest.mark.parametrize("verbosity, level", [(-1, logging.WARNING), (0, logging.INFO), (1, logging.DEBUG),
                                              (-5, logging.WARNING), (7, logging.DEBUG)])
def test_each_verbosity_sets_its_level_and_travels_in_the_env(verbosity, level):
    chosen = log.configure(verbosity)
    assert log.logger.level == level and not log.logger.propagate
    assert os.environ[log.VERBOSITY_ENV] == str(chosen) and log.worker_env() == {log.VERBOSITY_ENV: str(chosen)}
    assert log.ray_log_level() == (logging.INFO if chosen == log.VERBOSE else logging.WARNING)


def test_quiet_hides_info_and_shows_warnings_and_errors_in_the_raydl_look(capsys):
    log.configure(log.QUIET)
    child = logging.getLogger("raydl.driver.somewhere")
    child.info("run directory: runs/x")
    child.warning("data.backend=ray: too few CPUs")
    child.error("it broke")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == ["[raydl] warning: data.backend=ray: too few CPUs", "[raydl] error: it broke"]


def test_configuring_again_keeps_one_handler_and_reads_the_env(capsys, monkeypatch):
    log.configure(log.VERBOSE)
    monkeypatch.setenv(log.VERBOSITY_ENV, "0")
    log.configure()
    log.ensure_configured()
    logging.getLogger("raydl.train.loop").debug("hidden at the default")
    logging.getLogger("raydl.train.loop").info("world size 2")
    assert capsys.readouterr().err == "[raydl] world size 2\n"


def test_a_stray_env_value_means_the_default(monkeypatch):
    monkeypatch.setenv(log.VERBOSITY_ENV, "loud")
    assert log.configure() == log.DEFAULT


def _text_file(tmp_path: Path) -> Path:
    rng = random.Random(0)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(" ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(20)) for _ in range(64)))
    return src


@pytest.mark.slow   # a raydl process each
@pytest.mark.parametrize("flags", [["-q"], ["data", "-q"], []], ids=["global", "per-command", "default"])
def test_cli_quiet_prints_no_info_lines(tmp_path, flags):
    argv = [RAYDL, *flags, *(["data"] if flags[:1] != ["data"] else []), "prepare", "--from", "text",
            str(_text_file(tmp_path)), "--out", str(tmp_path / "out"), "--seq-len", "16"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "", p.stderr
    if flags:
        assert p.stderr == ""
    else:
        assert "[raydl] wrote " in p.stderr and "[raydl] prepare: 1/1 files" in p.stderr


def test_quiet_and_verbose_together_are_refused():
    p = subprocess.run([RAYDL, "-q", "-v", "config", "show"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "not allowed with argument" in p.stderr


@pytest.mark.slow   # a real training process: about 6 s alone, 15+ s on a loaded machine
def test_a_worker_reads_the_verbosity_from_the_env(tmp_path, data_cache):
    """The torchrun entry, one process: with RAYDL_VERBOSITY=-1 no info line, and stdout is the summary alone."""
    sets = ["train.max_steps=4", "data.builtin_samples=512", "train.eval_batches=1", "telemetry.report_every=2",
            f"data.cache_dir={data_cache}"]
    p = subprocess.run([sys.executable, "-m", "raydl.worker", *[a for s in sets for a in ("--set", s)],
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, log.VERBOSITY_ENV: "-1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["steps"] == 4
    assert not [line for line in p.stderr.splitlines() if line.startswith("[raydl]")], p.stderr


SIGTERM_IN_A_WEAKREF_CALLBACK = """
import signal, sys, weakref
from raydl import log
if sys.argv[1] == "quiet":
    log.quiet_exits_in_callbacks()
    log.quiet_exits_in_callbacks()   # twice: one hook, not two

def sigterm_handler(signum, frame):   # what Ray's worker main loop installs
    sys.exit(1)

signal.signal(signal.SIGTERM, sigterm_handler)

class Thing:
    pass

def on_collect(ref):
    signal.raise_signal(signal.SIGTERM)   # the handler runs here, inside the callback

def broken(ref):
    1 / 0

first, second = Thing(), Thing()
refs = [weakref.ref(first, on_collect), weakref.ref(second, broken)]
del first, second
print("went on")
"""


@pytest.mark.parametrize("mode", ["default", "quiet"])
def test_an_exit_request_inside_a_callback_is_not_printed_and_other_errors_are(mode, tmp_path):
    script = tmp_path / "sigterm.py"
    script.write_text(SIGTERM_IN_A_WEAKREF_CALLBACK)
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "went on\n", done
    assert "ZeroDivisionError" in done.stderr, done.stderr
    assert ("SystemExit" in done.stderr) == (mode == "default"), done.stderr
    assert done.stderr.count("Exception ignored") == (2 if mode == "default" else 1), done.stderr
