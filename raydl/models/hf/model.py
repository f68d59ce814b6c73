"""The ModelSpec of `model.name: hf`: build (transformers model, untied head, raydl blocks) and FLOPs."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from raydl.models import gpt
from raydl.models.blocks import BlockModel
from raydl.models.hf.blocks import block_modules
from raydl.models.hf.config import hf_config
from raydl.models.hf.options import HfOptions
from raydl.models.hf.weights import SafetensorsSource, WeightsIndex, check_weights, expected_tensors
from raydl.models.packing import packed_kwargs
from raydl.models.spec import ModelSpec

__all__ = ["HfBlocks", "HfOptions", "build", "build_causal_lm", "spec"]


def build_causal_lm(options: HfOptions, meta: dict[str, Any]) -> nn.Module:
    """The transformers `*ForCausalLM`, in train mode, fp32, head untied from the embeddings; built on the
    current default device (on meta: shapes only), holding model.options.weights when it is real."""
    return HfBlocks.build(options, meta).causal_lm


class HfBlocks(BlockModel):
    """raydl's blocks of a transformers model (`raydl.models.hf.blocks`), and what a worker that built them on
    meta needs to materialize only its own part (read by `raydl.train.model_build`):

    - init_module(module): transformers' own `_init_weights` for one module (normal(0, initializer_range) for
      linears and embeddings, ones for norms, rotary inv_freq recomputed from the config)
    - init_like: {the untied head: the input embeddings} when the config ties them, so the head is drawn with
      the embeddings' seed and starts as their copy without any rank holding both
    - weights: model.options.weights, read per module by Hugging Face name (None: random init)
    """

    def __init__(self, causal_lm: nn.Module, *, tied: bool, weights: WeightsIndex | None):
        super().__init__(block_modules(causal_lm))
        self._causal_lm = [causal_lm]   # in a list: not a submodule (the blocks hold its modules under raydl names)
        self.init_like = {causal_lm.lm_head: causal_lm.get_input_embeddings()} if tied else {}
        hf_names = {module: name for name, module in causal_lm.named_modules()}
        self.weights = SafetensorsSource(weights, hf_names, _head_alias(causal_lm, tied)) if weights else None
        # GPT-2 scales the residual projections' init by depth in its attention and MLP modules' _init_weights.
        self._init_by_parent = {m.c_proj: m for m in causal_lm.modules() if type(m).__name__ in ("GPT2Attention",
                                                                                                "GPT2MLP")}

    @classmethod
    def build(cls, options: HfOptions, meta: dict[str, Any]) -> HfBlocks:
        from transformers import AutoModelForCausalLM

        config = hf_config(options, meta)
        tied = bool(config.tie_word_embeddings)
        causal_lm = AutoModelForCausalLM.from_config(config, attn_implementation=options.attention)
        _untie_head(causal_lm)
        weights = None
        if options.weights:   # headers only: a missing shard or tensor is refused before anything is read
            weights = check_weights(options.weights, expected_tensors(causal_lm), _head_alias(causal_lm, tied))
        blocks = cls(causal_lm.train(), tied=tied, weights=weights)
        if blocks.weights is not None and not _shapes_only():   # a whole build (export, tests): read it all
            for module in causal_lm.modules():
                blocks.weights.fill(module)
        return blocks

    @property
    def causal_lm(self) -> nn.Module:
        return self._causal_lm[0]

    @torch.no_grad()
    def init_module(self, module: nn.Module) -> None:
        # Back to this module's own seed (MetaInit seeded it), whatever reset_parameters drew first: a head
        # drawn like its embeddings then gets their very values.
        torch.manual_seed(torch.initial_seed())
        causal_lm = self.causal_lm
        causal_lm._init_weights(module)
        if module in self._init_by_parent:
            causal_lm._init_weights(self._init_by_parent[module])
        like = self.init_like.get(module)
        if like is not None and like.padding_idx is not None:
            module.weight[like.padding_idx] = 0   # as the embedding's init zeroes its padding row


def _head_alias(causal_lm: nn.Module, tied: bool) -> dict[str, str]:
    """A tied checkpoint holds no lm_head.weight: the head is read from the input embeddings' tensor."""
    if not tied:
        return {}
    embeddings = causal_lm.get_input_embeddings()
    return {"lm_head.weight": next(f"{name}.weight" for name, m in causal_lm.named_modules() if m is embeddings)}


def _shapes_only() -> bool:
    """Under `with torch.device("meta")` (the driver counting parameters, a worker before its layout)."""
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
    return HfBlocks.build(options, meta)


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
                 flops_per_sample=flops_per_sample, options=HfOptions, task="tokens", columns=("input_ids", "labels"),
                 forward_kwargs=packed_kwargs)
