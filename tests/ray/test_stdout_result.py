"""stdout carries only the result: `raydl -q train` of a user model that prints when it is built (in the
driver, and in every Ray worker, whose lines Ray forwards to the driver) prints the summary JSON alone on
stdout; the driver's print goes to stderr, the workers' to the run's ray.log (raydl.driver.ray_output). (A worker SIGKILLed mid-run, whose death Ray reports on the
driver's console: tests/ray/test_s3_e2e.py, which json.loads stdout too.) Also: a single-node
cluster (the session's Ray) takes the default, local checkpoint storage (raydl refuses it only on clusters of several
nodes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHATTY = "print('[mymodels.net] Net built')   # like nanoGPT's parameter count"


@pytest.mark.slow
def test_a_model_that_prints_leaves_stdout_to_the_summary(data_cache, tmp_path, on_shared_ray):
    source = (REPO / "tests" / "assets" / "own_net.py").read_text()
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "net.py").write_text(
        source.replace("        super().__init__()\n", f"        super().__init__()\n        {CHATTY}\n", 1))
    sets = ["model.name=mymodels.net:make_spec", f"data.cache_dir={data_cache}", "data.builtin_samples=4096",
            "train.max_steps=20", "telemetry.report_every=10", "checkpoint.every_steps=10", "train.eval_batches=1"]
    p = subprocess.run([str(Path(sys.executable).parent / "raydl"), "-q", "train",
                        *(a for s in sets for a in ("--set", s))], cwd=tmp_path, capture_output=True, text=True,
                       timeout=500)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads(p.stdout)
    assert summary["steps"] == 20 and Path(summary["checkpoint"]).is_dir()
    built = [line for line in p.stderr.splitlines() if "[mymodels.net] Net built" in line]
    assert built and all("pid=" not in line for line in built), built   # the driver's own print
    ray_log = (Path(summary["run_dir"]) / "ray.log").read_text()     # the workers' prints: off the console
    assert "(RayTrainWorker pid=" in ray_log and "[mymodels.net] Net built" in ray_log, ray_log[-4000:]
