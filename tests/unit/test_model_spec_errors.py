"""Every bad model.name / model.options given to `raydl train`: exit 2, one paragraph naming the field
and the fix, no traceback, no run directory, and Ray never started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raydl.cli import main

ASSETS = Path(__file__).resolve().parents[1] / "assets"
MODULES = {"mymodels/net.py": (ASSETS / "own_net.py").read_text(),
           "mymodels/boom.py": "raise RuntimeError('boom at import')\n", "mymodels/syntax.py": "def f(:\n",
           "mymodels/needs_dep.py": "import package_that_is_not_there\n"}


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    for name, text in MODULES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))   # the import path raydl adds goes with the test
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("mymodels")]:
        del sys.modules[name]


@pytest.mark.parametrize("sets, field, says", [
    (["model.name=mymodels.nothere:spec"], "model.name", "no module 'mymodels.nothere' is importable"),
    (["model.name=nopackage.good:spec"], "model.name", "no module 'nopackage.good'"),
    (["model.name=mymodels.net:nothing"], "model.name", "has no attribute 'nothing'"),
    (["model.name=mymodels.net:not_a_spec"], "model.name", "which is a int, not a raydl.ModelSpec"),
    (["model.name=mymodels.net:Net"], "model.name", "the class Net, not a raydl.ModelSpec"),
    (["model.name=mymodels.net:broken"], "model.name", "calling broken() raised ValueError: no weights here"),
    (["model.name=mymodels.boom:spec"], "model.name", "raised RuntimeError: boom at import"),
    (["model.name=mymodels.syntax:spec"], "model.name", "raised SyntaxError"),
    (["model.name=mymodels.needs_dep:spec"], "model.name", "No module named 'package_that_is_not_there'"),
    (["model.name=mymodels.net"], "model.name", "neither a built-in model"),
    (["model.name=gtp"], "model.name", "neither a built-in model (gpt, resnet, hf)"),
    (["model.name=mymodels.net:spec", "model.options.hiden=4"], "model.options.hiden", "not an option"),
    (["model.name=mymodels.net:make_spec", "model.options.hidden=wide"], "model.options.hidden", "type int"),
    (["model.name=mymodels.net:spec", "model.size=mini"], "model.size", "has no size option"),
    (["model.name=mymodels.net:wrong_blocks"], "model.name", "names 'head', which is not a top-level child"),
    (["model.name=mymodels.net:swapped_blocks"], "model.name", "do not reproduce its forward"),
    (["model.name=mymodels.net:untasked"], "data.path", "names no task"),
    (["model.name=mymodels.net:needs_column"], "no column 'weight'", "model 'own_column' reads"),
    (["model.name=mymodels.net:plain", "parallel.pp_degree=2"], "parallel.pp_degree", "without ModelSpec.blocks"),
    (["model.name=mymodels.net:plain", "parallel.pp_degree=auto"], "parallel.pp_degree", "without ModelSpec.blocks"),
])
def test_bad_model_exits_2_naming_the_field_before_ray_starts(models_dir, data_cache, sets, field, says, capsys):
    argv = ["train", "--set", f"run.runs_dir={models_dir / 'runs'}", "--set", f"data.cache_dir={data_cache}",
            "--set", "data.builtin_samples=512"]
    ray_was_up = _ray_up()   # a slow test before this one in the same session may have started it
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydl: error:") and "Traceback" not in err and err.count("\n") == 1, err
    assert field in err and says in err and "Fix:" in err, err
    assert not (models_dir / "runs").exists() and _ray_up() == ray_was_up


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


@pytest.mark.slow   # a process of its own
def test_job_entry_point_imports_model_name_from_the_working_dir(data_cache):
    """What `raydl submit` runs in the uploaded working dir: `python jobs/train.py` (sys.path[0] is jobs/)."""
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "jobs/train.py", "--set", "model.name=examples.mlp_classifier:spec",
                           "--set", "model.options.hidden=wide", "--set", f"data.cache_dir={data_cache}"],
                          cwd=repo, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "'model.options.hidden' must be of type int" in done.stderr, done.stderr


@pytest.mark.parametrize("given", [["--set", "model.name=mymodels.net:spec"], ["--config", "c.yaml"]])
def test_submit_refuses_a_model_module_left_out_of_the_upload(tmp_path, capsys, given):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "train.py").write_text("")
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "net.py").write_text("")
    (tmp_path / ".gitignore").write_text("mymodels/\n")
    (tmp_path / "c.yaml").write_text("model:\n  name: mymodels.net:spec\n")
    argv = ["submit", "--address", "http://127.0.0.1:9", "--working-dir", str(tmp_path), "--no-wait", "--", "train"]
    assert main(argv + given) == 2
    err = capsys.readouterr().err
    assert "model.name mymodels.net:spec is defined in mymodels/net.py, which the upload leaves out" in err, err
