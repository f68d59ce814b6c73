"""Ctrl-C / SIGTERM: the run checkpoints at its next report, prints how to resume and exits 128 + signal; and each
command raydl prints (raydl.commands) runs as printed: the resume of a stopped run started with a --set that shapes
the model, the resume of a failed run, the report of the run it finishes."""

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


@pytest.mark.parametrize("launcher, sig", [("ray", signal.SIGINT), ("torchrun", signal.SIGTERM)])
def test_first_signal_checkpoints_and_says_how_to_resume(launcher, sig, data_cache, tmp_path):
    # model.options.width: a run whose model is not the default one (issue 35: its resume built the default)
    sets = [*SETS, f"data.cache_dir={data_cache}", "scaling.min_workers=1", "scaling.max_workers=1",
            "model.options.width=48"]
    args = [a for s in sets for a in ("--set", s)]
    argv = ([RAYDL, "train", *args] if launcher == "ray"
            else [sys.executable, "-m", "raydl.worker", *args, "--run-dir", str(tmp_path / "runs" / "tr")])
    proc = start(argv, tmp_path)
    run_dir = first_record_written(tmp_path / "runs", proc, timeout_s=300)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 128 + sig, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by_signal"] == sig and 0 < summary["steps"] < 100000
    assert summary["checkpoint"] and Path(summary["checkpoint"]).name == f"step_{summary['steps']:08d}"
    # Lines forwarded from Ray's own actors carry "(Name pid=N)"; Ray's shutdown noise is not raydl's output.
    own = [line for line in out.splitlines() if "pid=" not in line]
    assert any("resume" in line for line in own) and not any("Traceback" in line for line in own), out[-3000:]
    if launcher == "ray":
        resume_as_printed(printed(out, "raydl train --resume"), run_dir, summary, tmp_path)


def resume_as_printed(argv: list[str], run_dir: Path, stopped: dict, cwd: Path) -> None:
    """The printed command continues the run, its model included, in a new run directory; SIGTERM stops it too."""
    assert argv == ["raydl", "train", "--resume", str(run_dir)], argv
    proc = start(argv, cwd)
    resumed_dir = first_record_written(cwd / "runs", proc, timeout_s=300, besides=run_dir)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert f"resuming the run of {run_dir} with its config unchanged" in out, out[-3000:]
    assert yaml.safe_load((resumed_dir / "config.yaml").read_text())["model"]["options"] == {"width": 48}
    summary = json.loads((resumed_dir / "summary.json").read_text())
    assert Path(summary["resumed_from"]).resolve() == Path(stopped["checkpoint"]).resolve(), summary
    assert summary["steps"] > stopped["steps"], summary
    assert stopped["steps"] < first_step(resumed_dir) <= stopped["steps"] + 5
    assert printed(out, "raydl train --resume") == ["raydl", "train", "--resume", str(resumed_dir)]


def test_a_failed_run_resumes_and_reports_as_printed(data_cache, tmp_path):
    """A worker fails once (debug.fail_at_step) where no failure is retried: one paragraph with the command that
    resumes it. Run as printed, it finishes (the failure fired already) and prints its report's command, which
    runs as printed too."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    sets = [*SETS, f"data.cache_dir={data_cache}", "scaling.min_workers=1", "scaling.max_workers=1",
            "train.max_steps=30", "checkpoint.every_steps=10", "scaling.max_failures=0", f"debug.ledger_dir={ledger}",
            "debug.fail_at_step=15"]
    failed = subprocess.run([RAYDL, "train", *[a for s in sets for a in ("--set", s)]], cwd=tmp_path, env=user_env(),
                            capture_output=True, text=True, timeout=600)
    paragraphs = [line for line in failed.stderr.splitlines() if line.startswith("raydl: error:")]
    assert failed.returncode == 1 and len(paragraphs) == 1, failed.stderr[-3000:]
    paragraph = paragraphs[0]
    assert "the run failed after 0 restart(s)" in paragraph, paragraph
    assert "injected failure at step 15" in paragraph and "step_00000010" in paragraph, paragraph
    [run_dir] = (tmp_path / "runs").iterdir()

    resumed = subprocess.run(printed(paragraph, "raydl train --resume"), cwd=tmp_path, env=user_env(),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["steps"] == 30 and Path(summary["resumed_from"]).name == "step_00000010", summary
    assert first_step(Path(summary["run_dir"])) == 11 and run_dir != Path(summary["run_dir"])

    report = subprocess.run(printed(resumed.stderr, "raydl report"), cwd=tmp_path, env=user_env(),
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and "resumed from" in report.stdout, report.stderr[-3000:]
    assert (Path(summary["run_dir"]) / "report.png").is_file()
