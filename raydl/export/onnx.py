"""--format onnx: a checkpoint of raydl's gpt, resnet or any model whose ModelSpec gives example_inputs, as ONNX.

    session = onnxruntime.InferenceSession("DIR/model.onnx")
    outputs = session.run(None, {"inputs": inputs.numpy()})[0]   # inputs as ModelSpec.inputs_targets gives them

Traced with `torch.onnx.export(dynamo=True)` (torch.export underneath) from the model rebuilt from the
checkpoint; needs pip install "raydl[onnx]". The batch size is free, and for token models so is the
sequence length, up to the dataset's. Large weights go to DIR/model.onnx.data beside the graph. ONNX is
the input TensorRT takes (`trtexec --onnx=DIR/model.onnx`); building an engine is left to a GPU machine.
Before DIR appears, onnxruntime runs the written file on a batch of another size than the traced one,
and its outputs must match raydl's within 1e-4.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

import torch
from torch.export import Dim

from raydl.errors import ConfigError
from raydl.export.trained import Trained

FILE = "model.onnx"
TOLERANCE = 1e-4   # onnxruntime's kernels sum in other orders than torch's
INSTALL = 'install the extra: pip install "raydl[onnx]" (onnx, onnxruntime, onnxscript)'


class OnnxExport:
    def __init__(self, trained: Trained):
        _require_onnx_packages()
        spec = trained.choice.spec
        if not callable(spec.example_inputs):
            raise ConfigError("model.name", f"names model '{spec.name}', whose ModelSpec has no example_inputs, which "
                              f"the ONNX export traces the model with", "give the spec example_inputs=lambda meta, n: "
                              "<a batch of n model inputs> (see raydl.ModelSpec), or export with --format hf")
        self.model = trained.load_into(trained.build())
        self.meta, self.spec = trained.meta, spec
        free = {0: Dim("batch")}
        if spec.task == "tokens":
            free[1] = Dim("seq", max=trained.meta["seq_len"])
        try:
            with _quiet_exporter():
                self.program = torch.onnx.export(self.model, (spec.example_inputs(trained.meta, 2),), dynamo=True,
                                                 input_names=["inputs"], output_names=["outputs"],
                                                 dynamic_shapes=(free,), verbose=False)
        except Exception as e:   # data-dependent control flow, ops ONNX lacks
            raise ConfigError("--format", f"is onnx, but torch.onnx.export cannot export model '{spec.name}' "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:300]})",
                              "make its forward traceable by torch.export, or use --format pt2") from None

    def write(self, out: Path) -> None:
        self.program.save(str(out / FILE))
        self._check(out)

    @torch.no_grad()
    def _check(self, out: Path) -> None:
        """Refuse an export whose outputs in onnxruntime differ from raydl's (a raydl bug, never the user's input)."""
        import onnxruntime

        x = self.spec.example_inputs(self.meta, 3)
        session = onnxruntime.InferenceSession(str(out / FILE), providers=["CPUExecutionProvider"])
        (got,) = session.run(None, {"inputs": x.numpy()})
        diff = float((torch.from_numpy(got) - self.model(x)).abs().max())
        if diff > TOLERANCE:
            raise RuntimeError(f"the ONNX model gives outputs {diff:.2e} away from raydl's model in onnxruntime "
                               f"(> {TOLERANCE}); nothing was written")


def _require_onnx_packages() -> None:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401   torch.onnx.export(dynamo=True) translates through it
    except ImportError as e:
        raise ConfigError("--format", f"is onnx, but the Python package {e.name!r} is not installed", INSTALL) from None


@contextlib.contextmanager
def _quiet_exporter():
    """Without torch's notes on torchvision ops it skips (raydl's models use none) and its own deprecations."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
            yield
    finally:
        registration.setLevel(level)
