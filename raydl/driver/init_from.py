"""`train.init_from`: a new run that starts from trained weights only (fine-tuning), not a resume.

    train.init_from: runs/pretrain                      # its newest usable checkpoint
    train.init_from: runs/pretrain/train/step_00000200  # that checkpoint
    train.init_from: my_llama                           # a save_pretrained directory (model.name=hf)

A raydl checkpoint's model tensors load into this run's layout, whatever layout saved them (DCP reshards);
its optimizer state and data position are not read: the run starts at step 0 of its own dataset. Before any
worker starts, every tensor the model builds is looked up in the checkpoint's `.metadata` (read without running
code, raydl.train.safe_dcp) with its shape, so another architecture, or a dataset tokenized with another
vocabulary, is refused naming the field. A Hugging Face directory is read as model.options.weights is (headers
checked on the driver, each rank reading its own slices). The workers load the checkpoint with
raydl.train.checkpoint.load_weights.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from raydl import storage
from raydl.config import JobConfig
from raydl.errors import ConfigError

FIELD = "train.init_from"


def is_hf_dir(path: str) -> bool:
    folder = Path(path).expanduser()
    return (folder / "config.json").is_file() and any(
        (folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))


def as_hf_weights(cfg: JobConfig, model_name: str) -> JobConfig:
    """A Hugging Face directory in train.init_from becomes model.options.weights (this run's model is built from it)."""
    path = cfg.train.init_from
    if not path or not is_hf_dir(path):
        return cfg
    if model_name != "hf":
        raise ConfigError(FIELD, f"is '{path}', a Hugging Face directory, but model.name is {model_name!r}",
                          "set model.name=hf to fine-tune it, or pass a raydl run directory or checkpoint")
    options = dict(cfg.model.options)
    if options.get("weights"):
        raise ConfigError(FIELD, f"and model.options.weights are both set ('{path}', '{options['weights']}')",
                          "keep one of them")
    options["weights"] = str(Path(path).expanduser().resolve())
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, options=options),
                               train=dataclasses.replace(cfg.train, init_from=options["weights"]))


def resolve(cfg: JobConfig, model, meta: dict[str, Any]) -> str | None:
    """The checkpoint train.init_from names (None: none, or a Hugging Face directory, read as weights), checked to
    hold every tensor of `model` (built on meta for this run's dataset) with its shape."""
    path = cfg.train.init_from
    if not path or is_hf_dir(path):
        return None
    from raydl.driver.run_location import checkpoints_location
    from raydl.errors import CheckpointError
    from raydl.train import checkpoint as ckpt
    from raydl.train import safe_dcp

    uri = storage.is_uri(path)
    if not uri and not Path(path).expanduser().exists():
        raise ConfigError(FIELD, f"is '{path}', which does not exist", "pass a raydl run directory, one of its "
                          "checkpoints (train/step_N) or a Hugging Face save_pretrained directory")
    try:
        found = ckpt.resolve_resume(checkpoints_location(path if uri else str(Path(path).expanduser())))
    except CheckpointError as e:
        raise ConfigError(FIELD, f"is '{path}', which holds no usable raydl checkpoint ({e})",
                          "pass a run directory that saved a checkpoint, a checkpoint directory, or a Hugging Face "
                          "save_pretrained directory (config.json + model.safetensors)") from None
    try:
        saved = {key[len("model."):]: tuple(entry.size) for key, entry in _metadata(str(found)).state_dict_metadata.items()
                 if key.startswith("model.") and hasattr(entry, "size")}
    except safe_dcp.UnsafeCheckpoint as e:
        raise ConfigError(FIELD, f"names checkpoint '{found}', which is not usable ({e})",
                          "pass a checkpoint you trust") from None
    check_fits(saved, {name: tuple(t.shape) for name, t in model.state_dict().items()}, str(found), meta)
    return str(found)


def _metadata(checkpoint: str):
    """The checkpoint's DCP metadata (in a bucket: its .metadata file alone is fetched), read without running code."""
    from raydl.train import safe_dcp

    if not storage.is_uri(checkpoint):
        return safe_dcp.read_metadata(checkpoint)
    fs, inside = storage.resolve(checkpoint, FIELD)
    with tempfile.TemporaryDirectory() as local:
        (Path(local) / safe_dcp.METADATA_FILE).write_bytes(storage.read_bytes(fs, f"{inside}/{safe_dcp.METADATA_FILE}"))
        return safe_dcp.read_metadata(local)


def check_fits(saved: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]], where: str,
               meta: dict[str, Any]) -> None:
    """Every tensor of the model is in the checkpoint with its shape; a differing vocabulary (the dataset's
    tokenizer against the model's) gets its own message."""
    missing = [name for name in wanted if name not in saved]
    wrong = {name: (saved[name], shape) for name, shape in wanted.items() if name in saved and saved[name] != shape}
    vocab = meta.get("vocab_size")
    if any(s[0] != w[0] and w[0] == vocab for s, w in wrong.values()):
        theirs = next(s[0] for s, w in wrong.values() if s[0] != w[0] and w[0] == vocab)
        raise ConfigError(FIELD, f"names a model with a vocabulary of {theirs} tokens (checkpoint '{where}'), but "
                          f"this run's dataset was tokenized with a vocabulary of {vocab}", "prepare the dataset with "
                          "the tokenizer the model was trained with (raydl data prepare --tokenizer), so the token ids "
                          "mean the same")
    if missing or wrong:
        detail = "; ".join([f"{n} is missing" for n in missing[:3]] +
                           [f"{n} is {list(s)} there, {list(w)} here" for n, (s, w) in list(wrong.items())[:3]])
        raise ConfigError(FIELD, f"names checkpoint '{where}', whose model does not fit the one this config builds "
                          f"({len(missing)} tensor(s) missing, {len(wrong)} of another shape: {detail})",
                          "set model.name, model.size and model.options as in the run that saved it")
