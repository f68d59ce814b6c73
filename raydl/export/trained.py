"""What export reads: a run's checkpoint, the config that trained it and its dataset's meta.

RUN_OR_CHECKPOINT is a run directory (its newest usable checkpoint, wherever its
checkpoint.storage_path put it, a bucket included) or one checkpoint (runs/<run>/train/step_NNNNNNNN,
or a URI). The config is the run's config.yaml, found in the run directory or above the checkpoint,
or --config for a checkpoint stored elsewhere (checkpoint.storage_path). The model is
rebuilt on the CPU from that config and the checkpoint loaded into it through raydl's checkpoint
loader (restricted reader: nothing in the checkpoint runs; no process group needed), whatever
layout saved it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from raydl import storage
from raydl.config import JobConfig
from raydl.config_lora import lora_settings
from raydl.data.dataset import DatasetInfo
from raydl.errors import CheckpointError
from raydl.models.blocks import BlockModel
from raydl.models.choice import ModelChoice, choose_model
from raydl.models.lora import adapter_init, apply_lora
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt
from raydl.train.model_build import build_for_worker

CONFIG_FILE = "config.yaml"
CHECKPOINT_FORM = "a run directory or one of its checkpoints (runs/<run>/train/step_NNNNNNNN)"


@dataclass(frozen=True)
class Trained:
    checkpoint: Path | str   # a URI for a checkpoint in a bucket
    cfg: JobConfig
    choice: ModelChoice
    data: DatasetInfo
    adapters: Adapters | None = None   # a LoRA run's (train.lora)

    @property
    def meta(self) -> dict:
        return self.data.meta

    def load_into(self, model: BlockModel) -> BlockModel:
        """The checkpoint's weights in `model` (built from this config by `build`), in eval mode."""
        fingerprint = self.adapters.fingerprint if self.adapters else self.choice.fingerprint(model)
        with warnings.catch_warnings():   # DCP's note that it loads without a process group: that is the intent
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            ckpt.load(self.checkpoint, model, [], fingerprint)
        return model.eval()

    def build(self) -> BlockModel:
        """The model this config trains; a LoRA run's with its adapters, on its base weights, as a worker builds
        it (its initial values seeded per module name: raydl.parallel.materialize)."""
        if self.adapters is None:
            torch.manual_seed(self.cfg.train.seed)
            return self.choice.build(self.meta)
        model, init = build_for_worker(self.choice, self.meta, self.cfg)
        apply_lora(model, settings=lora_settings(self.cfg.train.lora))
        if init is not None:
            adapter_init(init, model)(model, torch.device("cpu"))
        if self.adapters.base_checkpoint:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                ckpt.load_weights(self.adapters.base_checkpoint, model)
        return model


@dataclass(frozen=True)
class Adapters:
    """What a LoRA run's export needs beyond its checkpoint: the checkpoint the base weights are read from (None:
    model.options.weights or train.seed) and the fingerprint (adapters and base digest) the checkpoint must hold."""
    base_checkpoint: str | None
    fingerprint: dict


def _adapters(checkpoint: Path | str, cfg: JobConfig, choice: ModelChoice, data: DatasetInfo) -> Adapters | None:
    """A LoRA run's base weights, found where the run found them and checked against the digest its checkpoint
    recorded (the same refusal as a resume's)."""
    if lora_settings(cfg.train.lora) is None:
        return None
    from raydl.driver import init_from, lora_base
    from raydl.models.build import SkipWeightInit

    with torch.device("meta"), SkipWeightInit():
        plain = choice.build(data.meta)
    base_checkpoint = init_from.resolve(cfg, plain, data.meta)
    fingerprint = {**choice.fingerprint(plain), **lora_base.lora_fingerprint(cfg, base_checkpoint)}
    lora_base.check_same_base(ckpt.read_state(checkpoint).get("model", {}), fingerprint, str(checkpoint))
    return Adapters(base_checkpoint, fingerprint)


def find_trained(source: str, *, config: str | None = None) -> Trained:
    checkpoint = find_checkpoint(source)
    cfg = load_config(config or str(_run_config(checkpoint, source)), [])
    choice = choose_model(cfg.model)
    data = choice.open_dataset(cfg)
    return Trained(checkpoint, cfg, choice, data, _adapters(checkpoint, cfg, choice, data))


def find_checkpoint(source: str) -> Path | str:
    """`source` itself when it is a checkpoint (refused if damaged), else its newest usable one."""
    from raydl.driver.run_location import checkpoints_location

    path = checkpoints_location(source)
    fs, inside = storage.check(path, "export source")
    if not storage.exists(fs, inside):
        raise CheckpointError(f"export source '{source}' does not exist. Fix: pass {CHECKPOINT_FORM}.")
    if ckpt.is_complete(path):
        problem = ckpt.verify(path)
        if problem:
            raise CheckpointError(f"checkpoint '{path}' is not usable: {problem}. Fix: export an earlier checkpoint "
                                  f"of the run, or pass the run directory to take its newest usable one.")
        return ckpt.absolute(path)
    newest = ckpt.first_valid([str(c) for c in ckpt.all_complete(path)])
    if newest is None:
        raise CheckpointError(f"export source '{source}' holds no usable raydl checkpoint (a warning above names any "
                              f"skipped). Fix: pass {CHECKPOINT_FORM} that saved at least one checkpoint.")
    return ckpt.absolute(newest)


def _run_config(checkpoint: Path | str, source: str) -> Path:
    """The config.yaml of the run: in the run directory, which holds train/step_N (or names the bucket
    that holds its checkpoints)."""
    near = [Path(source)] if storage.is_uri(str(checkpoint)) else [checkpoint, *list(checkpoint.parents)[:2]]
    for folder in near:
        if (folder / CONFIG_FILE).is_file():
            return folder / CONFIG_FILE
    raise CheckpointError(f"no {CONFIG_FILE} found with checkpoint '{checkpoint}' (a run directory holds one, two "
                          f"levels above its checkpoints). Fix: pass the run's config with --config, or pass the run "
                          f"directory instead of '{source}'.")
