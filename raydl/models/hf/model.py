"""The ModelSpec of `model.name: hf`: build (transformers model, untied head, raydl blocks) and FLOPs."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from raydl.models import gpt
from raydl.models.blocks import BlockModel
from raydl.models.hf.classes import model_class
from raydl.models.hf.config import hf_config, weight_files
from raydl.models.hf.options import HfOptions
from raydl.models.spec import ModelSpec

__all__ = ["HfOptions", "build", "build_causal_lm", "spec"]


def build_causal_lm(options: HfOptions, meta: dict[str, Any]) -> nn.Module:
    """The transformers `*ForCausalLM`, in train mode, fp32, head untied from the embeddings."""
    model = _load_or_init(options, hf_config(options, meta))
    _untie_head(model)
    return model.train()


def _load_or_init(options: HfOptions, config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if options.weights and not _shapes_only():
        weight_files(options.weights)
        return model_class(config.model_type).from_pretrained(
            options.weights, config=config, local_files_only=True, use_safetensors=True, dtype=torch.float32,
            attn_implementation=options.attention)
    return AutoModelForCausalLM.from_config(config, attn_implementation=options.attention)


def _shapes_only() -> bool:
    """Under `with torch.device("meta")` (the driver counting parameters): no weights to read."""
    return torch.empty(0).is_meta


def _untie_head(model: nn.Module) -> None:
    if not model.config.tie_word_embeddings:
        return
    warnings.warn(f"model.name=hf: this {model.config.model_type} ties lm_head.weight to the input embeddings; raydl "
                  f"trains the head as its own parameter, starting as a copy of them (in a pipeline the two live on "
                  f"different stages). Export writes tie_word_embeddings=false.", stacklevel=3)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False


def build(options: HfOptions, meta: dict[str, Any]) -> BlockModel:
    from raydl.models.hf.blocks import as_blocks

    return as_blocks(build_causal_lm(options, meta))


def flops_per_sample(options: HfOptions, meta: dict[str, Any]) -> float:
    """PaLM appendix B, as for raydl's gpt: T·(6N + 12·L·d·T_attn), N = parameters outside the input
    embeddings (the head included), T_attn = the tokens each one attends to (a sliding window caps it)."""
    with torch.device("meta"):
        model = build_causal_lm(options, meta)
    config, seq_len = model.config, meta["seq_len"]
    embedding = sum(p.numel() for p in model.get_input_embeddings().parameters())
    positions = getattr(model.base_model, "wpe", None)
    embedding += positions.weight.numel() if positions is not None else 0
    n = sum(p.numel() for p in model.parameters()) - embedding
    attended = min(seq_len, getattr(config, "sliding_window", None) or seq_len)
    return seq_len * (6 * n + 12 * config.num_hidden_layers * config.hidden_size * attended)


spec = ModelSpec(name="hf", build=build, inputs_targets=gpt.tokens, loss=gpt.gpt_loss, example_inputs=gpt.random_tokens,
                 correct=gpt.gpt_correct, units_per_sample=lambda meta: meta["seq_len"],
                 flops_per_sample=flops_per_sample, options=HfOptions, task="tokens", columns=("input_ids", "labels"))
