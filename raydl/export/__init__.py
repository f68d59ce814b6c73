"""raydl export: a trained checkpoint as files that load without raydl.

    raydl export runs/<run> --format hf --out my_model     # model.name=hf: save_pretrained output
    raydl export runs/<run>/train/step_00000200 --format pt2 --out my_program   # any model: torch.export

Any layout's checkpoint (dp × pp, any world size) exports: the model is rebuilt whole on the CPU
(`raydl.export.trained`). The output is written beside --out and renamed into place after it was
loaded back and checked against raydl's model, so a failure leaves nothing at --out.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch

from raydl.errors import ConfigError

FORMATS = ("hf", "pt2", "onnx")
TOLERANCE = 1e-5   # largest |difference| allowed between the exported model's outputs and raydl's


def export(source: str, *, fmt: str, out: str, config: str | None = None) -> Path:
    """Write `source`'s checkpoint to the new directory `out` in format `fmt`; returns `out`."""
    if fmt not in FORMATS:
        raise ConfigError("--format", f"is {fmt!r}, not one of {', '.join(FORMATS)}", "use --format hf, pt2 or onnx")
    target = Path(os.path.abspath(out))
    _refuse_existing(out, target)
    from raydl.export.trained import find_trained

    trained = find_trained(source, config=config)
    if fmt == "hf":
        from raydl.export.hf import HfExport as Writer
    elif fmt == "pt2":
        from raydl.export.pt2 import Pt2Export as Writer
    else:
        from raydl.export.onnx import OnnxExport as Writer
    writer = Writer(trained)   # everything is loaded and checked before anything is written
    staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        staging.mkdir(parents=True)
        writer.write(staging)
        if target.exists():
            target.rmdir()   # empty, as checked
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _refuse_existing(out: str, target: Path) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError("--out", f"'{out}' already exists and is not an empty directory",
                          "choose a new directory (raydl export never writes over anything) or delete it")


def require_close(exported: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Refuse an export whose outputs differ from raydl's model's (a raydl bug, never the user's input)."""
    diff = float((exported - expected).abs().max())
    if diff > TOLERANCE:
        raise RuntimeError(f"the exported {what} gives outputs {diff:.2e} away from raydl's model (> {TOLERANCE}); "
                           f"nothing was written")
