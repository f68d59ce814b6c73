"""The base weights a LoRA run adapts: where they are and a digest of them, recorded in every checkpoint's model
fingerprint (a LoRA checkpoint holds the adapters alone), so that a resume or an export onto other base weights is
refused before anything loads.

    train.init_from: a raydl checkpoint     the sha256 of its files-rank<r>.json (each lists its files' sha256)
    model.options.weights: a HF directory   the sha256 of its *.safetensors files, in name order
    neither                                 the base drawn from train.seed (the digest of that seed)

The adapters' settings go into the fingerprint too: resuming with another rank, alpha or targets is refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from raydl import storage
from raydl.config import JobConfig
from raydl.config_lora import lora_settings
from raydl.errors import ConfigError

__all__ = ["lora_fingerprint", "check_same_base", "adapted"]


def lora_fingerprint(cfg: JobConfig, init_checkpoint: str | None) -> dict[str, Any]:
    """{} without LoRA; else what a checkpoint records of the adapters and of their base weights."""
    lora = lora_settings(cfg.train.lora)
    if lora is None:
        return {}
    location, digest = _base(cfg, init_checkpoint)
    targets = lora.targets if isinstance(lora.targets, str) else ",".join(lora.targets)
    return {"lora": f"rank={lora.rank} alpha={lora.alpha:g} dropout={lora.dropout:g} targets={targets}",
            "lora_base": location, "lora_base_digest": digest}


def _base(cfg: JobConfig, init_checkpoint: str | None) -> tuple[str, str]:
    weights = cfg.model.options.get("weights") if isinstance(cfg.model.options, dict) else None
    if init_checkpoint:
        return str(init_checkpoint), _checkpoint_digest(str(init_checkpoint))
    if weights:
        return str(weights), _files_digest(sorted(Path(weights).expanduser().glob("*.safetensors")))
    return f"seed {cfg.train.seed}", hashlib.sha256(f"raydl init, train.seed={cfg.train.seed}".encode()).hexdigest()


def _checkpoint_digest(checkpoint: str) -> str:
    from raydl.train import checkpoint as ckpt

    fs, inside = storage.resolve(checkpoint, "train.init_from")
    digest = hashlib.sha256()
    for rank in range(ckpt.read_state(checkpoint)["saved_by_ranks"]):
        digest.update(storage.read_bytes(fs, f"{inside}/files-rank{rank}.json"))
    return digest.hexdigest()


def _files_digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        with f.open("rb") as stream:
            while chunk := stream.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def check_same_base(saved: dict[str, Any], built: dict[str, Any], checkpoint: str) -> None:
    """A LoRA checkpoint continues only on the base weights its adapters were trained on."""
    if "lora_base_digest" not in saved or saved["lora_base_digest"] == built.get("lora_base_digest"):
        return
    now = built.get("lora_base", "no base weights (train.lora is empty)")
    digest = str(built.get("lora_base_digest"))[:12]
    raise ConfigError("train.init_from", f"gives the base weights {now} (sha256 {digest}…), "
                      f"but the adapters in checkpoint '{checkpoint}' were trained on {saved.get('lora_base')} "
                      f"(sha256 {saved['lora_base_digest'][:12]}…): adapters on other base weights compute another "
                      f"model", f"resume with the base the run trained on (train.init_from or model.options.weights "
                      f"= {saved.get('lora_base')}, unchanged), or start a new run without --resume")


def adapted(chosen, meta: dict[str, Any], cfg: JobConfig, built):
    """The model (on meta) as the workers will train it: with train.lora, a copy of `built` with its adapters, the
    rest frozen (what the memory prediction counts gradients and optimizer states of); else `built` itself. Targets
    that match nothing or that peft cannot wrap are refused here, before any worker starts."""
    import torch

    from raydl.models.build import SkipWeightInit
    from raydl.models.lora import apply_lora

    lora = lora_settings(cfg.train.lora)
    if lora is None:
        return built
    with torch.device("meta"), SkipWeightInit():
        model = chosen.build(meta, pp_degree=cfg.parallel.pp_degree)
        apply_lora(model, settings=lora)
    return model
