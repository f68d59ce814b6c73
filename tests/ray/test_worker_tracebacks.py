"""An error that raydl raises inside the workers (out of host memory, a shard changed after it was prepared, a
diverged loss) ends `raydl train` and `raydl sweep` with raydl's one paragraph: the console shows no traceback, and
the workers' tracebacks are in the run's workers.log, which the paragraph names. (`raydl train`'s diverged loss:
tests/ray/test_jobs_submit.py, in a job, whose logs are that command's console.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from raydl.data.dataset import ensure_builtin
from raydl.overrides import build_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_shared_ray")]

RAYDL = str(Path(sys.executable).parent / "raydl")
FAST = ["train.max_steps=30", "telemetry.report_every=10", "data.builtin_samples=4096", "train.eval_batches=2"]
# The runs that fail in a worker before their first step: what they check (raydl's paragraph, the tracebacks' file,
# no retry) is one worker's; a worker process fewer each. Two ranks' records: the sweep trial's, and test_jobs_submit's
# diverged job.
ONE_WORKER = ["scaling.min_workers=1", "scaling.max_workers=1"]


def console(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`raydl ARGS` with stdout and stderr interleaved as a terminal shows them."""
    return subprocess.run([RAYDL, *args], cwd=tmp_path, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)


def sets(*overrides: str) -> list[str]:
    return [arg for s in overrides for arg in ("--set", s)]


def assert_no_traceback(out: str) -> None:
    """No traceback on the console, but one of Ray's on a busy machine: Train's controller logs a warning with
    its traceback when its resource request to Ray's autoscaling coordinator times out (5 s), "safe to ignore"."""
    ray_warning = re.compile(r"\(TrainController pid=\d+\)")
    assert "Error in training function" not in out, out
    assert not [line for line in out.splitlines() if "Traceback" in line and not ray_warning.search(line)], out


def assert_paragraph_and_log(out: str, error_words: str, ranks: int | None) -> Path:
    """The console holds raydl's paragraph and no traceback; the file it names holds each failed rank's traceback
    (`ranks`: how many failed; None: any)."""
    assert_no_traceback(out)
    [paragraph] = [line for line in out.splitlines() if line.startswith("raydl: error:")]
    assert error_words in paragraph, paragraph
    log = Path(re.search(r"The workers' tracebacks are in (\S+)\.$", paragraph).group(1))
    text = log.read_text()
    records = text.count("--- rank ")   # one per failed rank, with its traceback (two when chained)
    assert log.name == "workers.log" and (records == ranks if ranks else records >= 1), text
    assert text.count("Traceback (most recent call last)") >= records and error_words in text, text
    return log


def test_worker_out_of_memory_prints_the_paragraph_and_is_not_retried(data_cache, tmp_path):
    """A worker's allocation failure (here building a 50 MB model whole under a 24 MiB cap on what it may allocate)
    is raydl's paragraph with what to change, exit 1, and no restart of the group: the same layout would fail again.
    One worker: its one record in workers.log is the one attempt (a retry would add a second)."""
    p = console(tmp_path, "train", *sets(*FAST, *ONE_WORKER, f"data.cache_dir={data_cache}",
                                         "debug.whole_model_build=true", "debug.memory_limit_mb=24",
                                         "model.options.width=512", "model.options.layers=4", "model.options.heads=8"))
    assert p.returncode == 1, p.stdout
    log = assert_paragraph_and_log(p.stdout, "ran out of host memory while building and loading its model",
                                   ranks=1)   # one attempt, not max_failures
    paragraph = next(line for line in p.stdout.splitlines() if line.startswith("raydl: error:"))
    assert "debug.memory_limit_mb" in paragraph and "parallel.dp_wrapper=fsdp" in paragraph, paragraph
    text = log.read_text()
    assert "can't allocate memory" in text, text


def test_shard_changed_after_prepare_prints_the_paragraph_and_logs_the_tracebacks(data_cache, tmp_path):
    built = Path(ensure_builtin(build_config({"data": {"cache_dir": str(data_cache), "builtin_samples": 4096}}),
                                "tokens"))
    shutil.copytree(built, tmp_path / "ds")
    shard = tmp_path / "ds" / "train-00001.parquet"
    pq.write_table(pq.read_table(shard), shard, compression="gzip")   # same rows, other bytes: the sha256 differs
    p = console(tmp_path, "train", *sets(*FAST, *ONE_WORKER, f"data.path={tmp_path / 'ds'}"))
    assert p.returncode == 2, p.stdout
    log = assert_paragraph_and_log(p.stdout, "train-00001.parquet", ranks=None)   # whichever read it first
    assert "DataError" in log.read_text()


def test_sweep_trial_that_diverges_prints_one_line_and_logs_the_tracebacks(data_cache, tmp_path):
    sweep = {"base": {"data": {"cache_dir": str(data_cache), "builtin_samples": 4096},
                      "train": {"max_steps": 10, "eval_batches": 2, "warmup_steps": 2},
                      "telemetry": {"report_every": 5, "progress": False},
                      "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 0.5}},
             "space": {"train.lr": [1e30]}, "objective": "eval_loss"}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    p = console(tmp_path, "sweep", "--config", "sweep.yaml")
    assert p.returncode == 0, p.stdout
    assert_no_traceback(p.stdout)
    [line] = [line for line in p.stdout.splitlines() if "failed (recorded as infeasible)" in line]
    workers_log, error_txt = re.search(r"traceback in (\S+) and (\S+)$", line).groups()
    assert Path(workers_log).read_text().count("raise TrainingDivergedError") == 2
    assert "TrainingDivergedError" in Path(error_txt).read_text()
    assert re.search(r"infeasible: TrainingDivergedError: training diverged", p.stdout), p.stdout
