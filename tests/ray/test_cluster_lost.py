"""A run whose Ray cluster goes away says so in one paragraph (which cluster, what was saved, how to resume), and the
command it prints resumes the run as printed: on a local Ray, since the cluster's address is gone with it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.bench.fault_cluster import poll
from tests.helpers import stop_processes
from tests.ray.test_stop import first_record_written, first_step, printed, start
from tests.ray.ray_head import short_tmp_dir, start_head


@pytest.mark.slow
def test_cluster_shut_down_mid_run_is_one_paragraph(data_cache, tmp_path):
    head = start_head(short_tmp_dir(), num_cpus=3)
    try:
        sets = ["train.max_steps=100000", "telemetry.report_every=5", "checkpoint.every_steps=10",
                f"data.cache_dir={data_cache}", "data.builtin_samples=4096"]
        argv = [str(Path(sys.executable).parent / "raydl"), "train", "--address", f"127.0.0.1:{head.gcs_port}",
                *[a for s in sets for a in ("--set", s)]]
        run = subprocess.Popen(argv, cwd=tmp_path, env=head.client_env(token_env=True), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        poll("a checkpoint of the run", lambda: run.poll() is not None or any(tmp_path.rglob("step_00000010")), 300)
    finally:
        stop_processes([head.proc.pid], grace_s=5)
    out, _ = run.communicate(timeout=300)
    own = [line for line in out.splitlines() if "pid=" not in line and not line.startswith("[20")]
    paragraph = [line for line in own if line.startswith("raydl: error:")]
    assert run.returncode == 1 and len(paragraph) == 1, out[-4000:]
    assert f"127.0.0.1:{head.gcs_port}" in paragraph[0] and "step_000000" in paragraph[0]
    assert "--resume" in paragraph[0] and not any("Traceback" in line for line in own), out[-4000:]

    argv = printed(paragraph[0], "raydl train --resume")
    run_dir = Path(argv[-1])
    assert argv == ["raydl", "train", "--resume", str(run_dir)], argv   # no --address of the cluster that went away
    resumed = start(argv, tmp_path)
    resumed_dir = first_record_written(tmp_path / "runs", resumed, timeout_s=300, besides=run_dir)
    resumed.send_signal(signal.SIGTERM)   # a resumed run stops at SIGTERM as at Ctrl-C (tests/ray/test_stop.py)
    out, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 128 + signal.SIGTERM, out[-4000:]
    assert printed(out, "raydl train --resume") == ["raydl", "train", "--resume", str(resumed_dir)]
    assert first_step(resumed_dir) > 10, out[-4000:]   # from the checkpoint the paragraph named, or a later one
