"""A Hugging Face causal LM as raydl blocks: embed, h0..h{n-1} (one per decoder layer), head.

    embed  = model.embed_tokens                (Llama, Qwen2, Mistral)  or  drop(wte + wpe)  (GPT-2)
    h<i>   = decoder layer i, with its own rotary embedding, position ids and causal mask
    head   = final norm + lm_head

The blocks hold the very submodules of the Hugging Face model (no copies), so loading a raydl
checkpoint into the blocks fills that model, which `save_pretrained` then writes. HF's own
`forward` computes positions, rotary (cos, sin) and the mask once and hands them to every layer;
a pipeline stage holds only some layers, so each layer block recomputes them from its input:
positions are 0..S-1, the mask is what HF's `masking_utils` builds for this layer's attention kind
(None with sdpa and full causal attention, i.e. SDPA's `is_causal`; a real mask for eager attention or a
sliding window). Packed rows (raydl.models.packing) come with their `documents`: positions restart per record
and the mask also keeps each record to itself.
"""

from __future__ import annotations

import torch
from torch import nn

from raydl.models.loss import VocabHead
from raydl.models.packing import document_positions

__all__ = ["block_modules"]


def _positions(hidden: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
    """0..S-1, or for packed rows each token's position in its record."""
    if documents is not None:
        return document_positions(documents)
    return torch.arange(hidden.shape[1], device=hidden.device)[None]


class TokenEmbedding(nn.Module):
    """Llama, Qwen2, Mistral: token embeddings only (positions enter as rotary, in every layer)."""

    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents`: taken as every block takes it (BlockModel); positions enter in the layers."""
        return self.embed_tokens(ids)


class LearnedPositionEmbedding(nn.Module):
    """GPT-2: token + learned position embeddings, then dropout."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.drop(self.wte(ids) + self.wpe(_positions(ids, documents)))


class DecoderLayer(nn.Module):
    """One HF decoder layer, callable on hidden states alone."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None, config, index: int):
        super().__init__()
        from transformers.masking_utils import (create_causal_mask, create_sliding_window_causal_mask,
                                                packed_sequence_mask_function)

        self.layer, self.rotary = layer, rotary
        self.config = config   # read by masking_utils: attention implementation, sliding window
        self.make_mask = create_sliding_window_causal_mask if _is_sliding(config, index) else create_causal_mask
        self.same_document = packed_sequence_mask_function

    def forward(self, hidden: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        positions = _positions(hidden, documents)
        # No position_ids for the mask: transformers would look for packed sequences in them with a data-dependent
        # `.all()` (a device sync per layer per step; fails on meta). Packed rows say their records instead: the
        # causal (or sliding-window) mask AND "same record", in the form this attention implementation takes.
        same = self.same_document(documents) if documents is not None else None
        mask = self.make_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                              position_ids=None, and_mask_function=same)
        extra = {"position_embeddings": self.rotary(hidden, positions)} if self.rotary is not None else {}
        # By keyword: GPT-2's block takes (hidden, past_key_values, attention_mask, ...) positionally.
        return self.layer(hidden, attention_mask=mask, position_ids=positions, use_cache=False, **extra)


def _is_sliding(config, index: int) -> bool:
    """Qwen2 names each layer's attention kind; Mistral slides every layer when it has a window."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return kinds[index] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


class Head(VocabHead):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def projection(self) -> nn.Linear:
        return self.lm_head

    def forward(self, hidden: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents`: taken as every block takes it (BlockModel); a token's head reads that token alone."""
        hidden = self.norm(hidden)
        return hidden if self.hidden_out else self.lm_head(hidden)   # (B, S, hidden) or (B, S, vocab)


def block_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The blocks of a Llama/Qwen2/Mistral- or GPT-2-shaped `*ForCausalLM` (see the module docstring), by name."""
    body, config = model.base_model, model.config
    if hasattr(body, "wte"):
        embed: nn.Module = LearnedPositionEmbedding(body.wte, body.wpe, body.drop)
        layers, norm, rotary_type = body.h, body.ln_f, None
    else:
        embed, layers, norm = TokenEmbedding(body.embed_tokens), body.layers, body.norm
        rotary_type = type(body.rotary_emb)
    blocks: dict[str, nn.Module] = {"embed": embed}
    for i, layer in enumerate(layers):
        # Its own rotary module (a few hundred bytes of non-persistent buffer): a stage may hold any layers.
        blocks[f"h{i}"] = DecoderLayer(layer, rotary_type(config=config) if rotary_type else None, config, i)
    blocks["head"] = Head(norm, model.lm_head)
    return blocks
