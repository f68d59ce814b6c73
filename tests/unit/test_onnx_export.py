"""raydl export --format onnx: gpt, resnet and a user's model from a checkpoint on disk, run in onnxruntime on
batches of other shapes than the traced one, match raydl's outputs within 1e-4; bad input exits 2 and writes
nothing. (The checkpoints: tests/unit/test_export.py's save_run, one rank.)"""

from __future__ import annotations

import sys

import pytest
import torch

from raydl.cli import main
from tests.unit.test_export import assert_refused, save_run, token_batch
from tests.unit.test_model_spec_errors import models_dir  # noqa: F401   (a fixture: mymodels/net.py in the cwd)

# torch.onnx.export takes 5-10 s per model here, and the first `raydl export --format onnx` of a process imports
# torch.onnx's exporter (~10 s), even where it then refuses: the whole file is the slow part's.
pytestmark = pytest.mark.slow

NO_EXAMPLE = ("import dataclasses\nfrom mymodels.net import plain\n"
              "spec = dataclasses.replace(plain, name='own_noexample', example_inputs=None)\n")


def batches(name: str, meta: dict) -> list[torch.Tensor]:
    """Batches of other sizes than the 2 rows export traces with (and for gpt, shorter sequences)."""
    if name == "gpt":
        return [token_batch(meta, 5), token_batch(meta, 1)[:, :meta["seq_len"] - 3]]
    generator = torch.Generator().manual_seed(7)
    return [torch.rand(rows, *meta["image_shape"], generator=generator) for rows in (5, 1)]


@pytest.mark.parametrize("name", ["gpt", "resnet", "mymodels.net:plain"])
def test_onnx_export_runs_in_onnxruntime_with_raydls_outputs(name, models_dir, data_cache):
    import onnx
    import onnxruntime

    model, meta = save_run(models_dir / "run", [f"model.name={name}", f"data.cache_dir={data_cache}"])
    out = models_dir / "onnx"
    assert main(["export", str(models_dir / "run"), "--format", "onnx", "--out", str(out)]) == 0
    graph = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(graph, full_check=True)
    (given,), (got,) = graph.graph.input, graph.graph.output
    assert (given.name, got.name) == ("inputs", "outputs")
    dims = [d.dim_param for d in given.type.tensor_type.shape.dim]
    assert dims[0] == "batch" and (dims[1] == "seq" if name == "gpt" else not any(dims[1:]))
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    for x in batches(name, meta):
        (outputs,) = session.run(None, {"inputs": x.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(outputs), model(x), rtol=0, atol=1e-4)
    assert not list(models_dir.glob(".onnx.partial-*"))


def test_a_model_without_example_inputs_is_refused(models_dir, data_cache, capsys):
    (models_dir / "mymodels" / "noexample.py").write_text(NO_EXAMPLE)
    save_run(models_dir / "run", ["model.name=mymodels.noexample:spec", f"data.cache_dir={data_cache}"])
    out = models_dir / "onnx"
    assert_refused(capsys, ["export", str(models_dir / "run"), "--format", "onnx", "--out", str(out)], out,
             "model.name", "'own_noexample'", "no example_inputs", "Fix: give the spec example_inputs=")


@pytest.mark.parametrize("package", ["onnx", "onnxruntime", "onnxscript"])
def test_onnx_not_installed_names_the_extra(package, tmp_path, data_cache, capsys, monkeypatch):
    save_run(tmp_path / "run", ["model.name=resnet", f"data.cache_dir={data_cache}"])
    monkeypatch.setitem(sys.modules, package, None)   # what `import` sees when the package is absent
    out = tmp_path / "onnx"
    assert_refused(capsys, ["export", str(tmp_path / "run"), "--format", "onnx", "--out", str(out)], out,
             "--format", f"'{package}' is not installed", 'pip install "raydl[onnx]"')
