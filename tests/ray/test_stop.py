"""Ctrl-C / SIGTERM: the run checkpoints at its next report, prints how to resume and exits 128 + signal; and each
command raydl prints (raydl.commands) runs as printed: the resume of a failed run started with a --set that shapes
the model, the resume of that resumed run stopped by Ctrl-C, the report of the run it finishes. (SIGTERM to a
resumed `raydl train`: tests/ray/test_late_start.py::test_cluster_shut_down_mid_run_is_one_paragraph.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raydl.bench.fault_cluster import poll

pytestmark = pytest.mark.slow
RAYDL = str(Path(sys.executable).parent / "raydl")


def first_record_written(run_root: Path, proc: subprocess.Popen, timeout_s: float, *, besides: Path | None = None) -> Path:
    """The run directory under `run_root` (other than `besides`) whose metrics.jsonl has a record."""
    def written() -> list[Path]:
        return [p.parent for p in run_root.rglob("metrics.jsonl") if p.parent != besides and p.stat().st_size]

    try:
        poll(f"a step record under {run_root}", lambda: proc.poll() is not None or written(), timeout_s)
    except TimeoutError:
        proc.kill()   # its private Ray goes with it
        raise
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before its first record:\n" \
        f"{proc.stdout.read()[-3000:]}"
    return written()[0]


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=cwd, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def user_env() -> dict[str, str]:
    """A user's shell: `raydl` on the PATH."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": f"{Path(RAYDL).parent}{os.pathsep}{os.environ['PATH']}"}


def printed(out: str, beginning: str) -> list[str]:
    """The last command starting with `beginning` that raydl printed (between backticks, or ending its line after
    'with: ' or ': '), split as a shell splits it."""
    found = re.findall(rf"`({re.escape(beginning)}[^`]*)`|: ({re.escape(beginning)}.*)$", out, re.M)
    assert found, f"no `{beginning} ...` printed:\n{out[-3000:]}"
    return shlex.split(next(c for c in found[-1] if c))


def first_step(run_dir: Path) -> int:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["step"]


SETS = ["train.max_steps=100000", "telemetry.report_every=5", "checkpoint.every_steps=100000",
        "data.builtin_samples=4096", "train.eval_batches=2", "telemetry.progress=false"]


def test_first_signal_checkpoints_and_says_how_to_resume(data_cache, tmp_path):
    """SIGTERM to `python -m raydl.worker`, the loop torchrun starts (no Ray); Ctrl-C to `raydl train`:
    test_a_failed_run_resumes_stops_at_ctrl_c_and_finishes_as_printed."""
    sets = [*SETS, f"data.cache_dir={data_cache}", "scaling.min_workers=1", "scaling.max_workers=1"]
    proc = start([sys.executable, "-m", "raydl.worker", *[a for s in sets for a in ("--set", s)], "--run-dir",
                  str(tmp_path / "runs" / "tr")], tmp_path)
    run_dir = first_record_written(tmp_path / "runs", proc, timeout_s=300)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert_stopped_by_first_signal(proc.returncode, out, run_dir, signal.SIGTERM, max_steps=100000)


def assert_stopped_by_first_signal(returncode: int, out: str, run_dir: Path, sig: int, max_steps: int) -> dict:
    """Exit 128 + signal, a checkpoint at the step it stopped, a line that says how to resume and no traceback:
    the summary."""
    assert returncode == 128 + sig, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by_signal"] == sig and 0 < summary["steps"] < max_steps
    assert summary["checkpoint"] and Path(summary["checkpoint"]).name == f"step_{summary['steps']:08d}"
    # Lines forwarded from Ray's own actors carry "(Name pid=N)"; Ray's shutdown noise is not raydl's output.
    own = [line for line in out.splitlines() if "pid=" not in line]
    assert any("resume" in line for line in own) and not any("Traceback" in line for line in own), out[-3000:]
    return summary


MAX_STEPS, FAIL_AT, HOLD_AT = 60, 15, 20


def test_a_failed_run_resumes_stops_at_ctrl_c_and_finishes_as_printed(data_cache, tmp_path):
    """Each command raydl prints, run as printed, on a private Ray: a worker fails once (debug.fail_at_step) where no
    failure is retried, and one paragraph names the command that resumes the run; resumed, it gets Ctrl-C (held at a
    step until then, debug.hold_at_step) and names the command that resumes it; resumed again, it finishes (the
    failure fired already) and names its report's command. model.options.width: a run whose model is not the default
    one (issue 35: its resume built the default)."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    sets = [*SETS, f"data.cache_dir={data_cache}", "scaling.min_workers=1", "scaling.max_workers=1",
            "model.options.width=48", f"train.max_steps={MAX_STEPS}", "checkpoint.every_steps=10",
            "scaling.max_failures=0", f"debug.ledger_dir={ledger}", f"debug.fail_at_step={FAIL_AT}",
            f"debug.hold_at_step={HOLD_AT}"]
    failed = subprocess.run([RAYDL, "train", *[a for s in sets for a in ("--set", s)]], cwd=tmp_path, env=user_env(),
                            capture_output=True, text=True, timeout=600)
    paragraphs = [line for line in failed.stderr.splitlines() if line.startswith("raydl: error:")]
    assert failed.returncode == 1 and len(paragraphs) == 1, failed.stderr[-3000:]
    paragraph = paragraphs[0]
    assert "the run failed after 0 restart(s)" in paragraph, paragraph
    assert f"injected failure at step {FAIL_AT}" in paragraph and "step_00000010" in paragraph, paragraph
    [run_dir] = (tmp_path / "runs").iterdir()

    stopped_dir, stopped, out = resume_then_ctrl_c(printed(paragraph, "raydl train --resume"), run_dir, ledger,
                                                   tmp_path)
    assert Path(stopped["resumed_from"]).name == "step_00000010" and first_step(stopped_dir) == 11, stopped
    assert run_dir != stopped_dir

    resumed = subprocess.run(printed(out, "raydl train --resume"), cwd=tmp_path, env=user_env(),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["steps"] == MAX_STEPS and summary["steps"] > stopped["steps"], summary
    assert Path(summary["resumed_from"]).resolve() == Path(stopped["checkpoint"]).resolve(), summary
    assert first_step(Path(summary["run_dir"])) == stopped["steps"] + 1 and stopped_dir != Path(summary["run_dir"])

    report = subprocess.run(printed(resumed.stderr, "raydl report"), cwd=tmp_path, env=user_env(),
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and "resumed from" in report.stdout, report.stderr[-3000:]
    assert (Path(summary["run_dir"]) / "report.png").is_file()


def resume_then_ctrl_c(argv: list[str], run_dir: Path, ledger: Path, cwd: Path) -> tuple[Path, dict, str]:
    """The printed command continues the run, its model included, in a new run directory; Ctrl-C, sent while it is
    held after step HOLD_AT, stops it at a later report: its run directory, summary and console."""
    assert argv == ["raydl", "train", "--resume", str(run_dir)], argv
    console = cwd / "resumed.out"
    with console.open("w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=user_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        poll(f"the resumed run held after step {HOLD_AT}",
             lambda: proc.poll() is not None or any(ledger.glob("held-*")), 300)
        assert proc.poll() is None, console.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)
        # Released once the driver has passed the stop on: the ranks see it at a report soon after, before the end.
        poll("the driver's stop request",
             lambda: proc.poll() is not None or "stopping at the next report" in console.read_text(), 60)
        (ledger / "release").touch()
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()   # the test failed on the way: its private Ray goes with it
    out = console.read_text()
    [resumed_dir] = [p.parent for p in (cwd / "runs").glob("*/metrics.jsonl") if p.parent != run_dir]
    stopped = assert_stopped_by_first_signal(proc.returncode, out, resumed_dir, signal.SIGINT, max_steps=MAX_STEPS)
    assert stopped["steps"] > HOLD_AT, stopped
    assert f"resuming the run of {run_dir} with its config unchanged" in out, out[-3000:]
    assert yaml.safe_load((resumed_dir / "config.yaml").read_text())["model"]["options"] == {"width": 48}
    assert printed(out, "raydl train --resume") == ["raydl", "train", "--resume", str(resumed_dir)]
    return resumed_dir, stopped, out
