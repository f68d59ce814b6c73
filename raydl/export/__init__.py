"""raydl export: a trained checkpoint as files that load without raydl.

    raydl export runs/<run> --format hf --out my_model     # model.name=hf: save_pretrained output
    raydl export runs/<run>/train/step_00000200 --format pt2 --out my_program   # any model: torch.export
    raydl export runs/<lora run> --adapter my_adapter      # train.lora: a peft adapter directory (--format peft)

Any layout's checkpoint (dp × pp, any world size) exports: the model is rebuilt whole on the CPU
(`raydl.export.trained`). The output is written beside --out and renamed into place after it was
loaded back and checked against raydl's model, so a failure leaves nothing at --out. A URI --out
(s3://, gs://, ...) gets the checked directory uploaded, its files one by one, and a failed upload
removed again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import torch

from raydl import storage
from raydl.errors import ConfigError

FORMATS = ("hf", "pt2", "onnx", "peft")
TOLERANCE = 1e-5   # largest |difference| allowed between the exported model's outputs and raydl's


def export(source: str, *, fmt: str, out: str, config: str | None = None) -> Path | str:
    """Write `source`'s checkpoint to the new directory `out` (a path or a URI) in format `fmt`; returns `out`."""
    if fmt not in FORMATS:
        raise ConfigError("--format", f"is {fmt!r}, not one of {', '.join(FORMATS)}",
                          "use --format hf, pt2, onnx or peft")
    fs, remote = storage.check(out, "--out")
    target = Path(os.path.abspath(remote)) if isinstance(fs, pafs.LocalFileSystem) else None
    _refuse_existing(out, fs, remote)
    from raydl.export.trained import find_trained

    trained = find_trained(source, config=config)
    if fmt == "hf":
        from raydl.export.hf import HfExport as Writer
    elif fmt == "pt2":
        from raydl.export.pt2 import Pt2Export as Writer
    elif fmt == "peft":
        from raydl.export.peft_adapter import PeftExport as Writer
    else:
        from raydl.export.onnx import OnnxExport as Writer
    writer = Writer(trained)   # everything is loaded and checked before anything is written
    parent = target.parent if target else Path(tempfile.gettempdir())   # a URI's copy is staged locally
    staging = parent / f".{Path(remote).name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(parents=True)
        writer.write(staging)
        if target is None:
            _upload(staging, fs, remote)
            return out
        if target.exists():
            target.rmdir()   # empty, as checked
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _upload(staging: Path, fs: pafs.FileSystem, remote: str) -> None:
    try:
        storage.upload_dir(str(staging), fs, remote)
    except BaseException:
        storage.remove_dir(fs, remote)
        raise


def _refuse_existing(out: str, fs: pafs.FileSystem, path: str) -> None:
    if not storage.is_empty_or_missing(fs, path):
        raise ConfigError("--out", f"'{out}' already exists and is not an empty directory",
                          "choose a new directory (raydl export never writes over anything) or delete it")


def require_close(exported: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Refuse an export whose outputs differ from raydl's model's (a raydl bug, never the user's input)."""
    diff = float((exported - expected).abs().max())
    if diff > TOLERANCE:
        raise RuntimeError(f"the exported {what} gives outputs {diff:.2e} away from raydl's model (> {TOLERANCE}); "
                           f"nothing was written")
