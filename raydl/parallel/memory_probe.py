"""What `raydl.parallel.memory` predicts from: each block's parameters and the activations its backward keeps,
read off a model built on `meta` (no storage: a 1B model costs milliseconds and no memory).

Activations are counted with autograd's saved-tensor hooks during one forward of one sample on meta: every
tensor backward keeps, once per storage (a view keeps its whole base alive), parameters excluded (they are
counted as weights). On meta, scaled_dot_product_attention takes the math path, which keeps the attention
matrix: an overestimate where a fused kernel would keep only its log-sum-exp.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from raydl.models.blocks import BlockModel
from raydl.models.loss import chunk_bytes, chunked, head_output, vocab_head
from raydl.models.spec import ModelSpec
from raydl.parallel.memory import BlockMemory, ModelMemory
from raydl.parallel.profile import ModelProfile

__all__ = ["model_memory", "from_profile"]

log = logging.getLogger(__name__)


def model_memory(model: BlockModel, spec: ModelSpec, meta: dict[str, Any], *,
                 activations: bool = True) -> ModelMemory:
    """Per block: fp32 parameter bytes, the largest tensor, and (when the model is on meta and its forward runs
    there) the activation and output bytes of one sample. `activations=False` skips that forward, for a caller
    that uses only the parameters: torch's meta kernels import torch._dynamo and sympy, a CPU-second or more."""
    sizes = [(name, _param_bytes(block), _largest(block), _param_bytes(block, trainable=True))
             for name, block in model.blocks.items()]
    tied = sum(_param_bytes(block) for block in model.blocks.values()) - _param_bytes(model)
    by_chunks = chunked(spec.loss, model)
    counted = None
    if activations and _on_meta(model):
        with head_output(model, hidden=by_chunks):   # as the step runs it (raydl.models.loss.model_loss)
            counted = _meta_activations(model, spec, meta)
    if counted is None:
        return ModelMemory(tuple(BlockMemory(n, p, 0.0, 0.0, t, g) for n, p, t, g in sizes), activations_known=False,
                           tied_bytes=tied)
    blocks = tuple(BlockMemory(n, p, act, out, t, g) for (n, p, t, g), (act, out) in zip(sizes, counted))
    if not by_chunks:
        return ModelMemory(blocks, loss_bytes=blocks[-1].output_bytes, tied_bytes=tied)   # logits' log-probabilities
    # Chunk by chunk: the head's hidden states and each token's label and log-sum-exp kept, one chunk's logits
    # (and their gradient) at a time.
    tokens = spec.example_inputs(meta, 1).numel()
    vocab = vocab_head(model).projection().weight.shape[0]
    return ModelMemory(blocks, loss_bytes=blocks[-1].output_bytes + tokens * (8 + 4),
                       loss_chunk_bytes=chunk_bytes(vocab), tied_bytes=tied)


def from_profile(profile: ModelProfile) -> ModelMemory:
    """The planner's measured profile (real activations at `profile.micro_batch` samples) as per-sample memory."""
    n = profile.micro_batch
    blocks = tuple(BlockMemory(b.name, b.param_bytes, b.activation_bytes / n, b.output_bytes / n, b.param_bytes)
                   for b in profile.blocks)
    return ModelMemory(blocks, loss_bytes=blocks[-1].output_bytes)


def _param_bytes(module: nn.Module, *, trainable: bool = False) -> int:
    return sum(p.numel() * 4 if p.is_floating_point() else p.numel() * p.element_size() for p in module.parameters()
               if p.requires_grad or not trainable)


def _largest(module: nn.Module) -> int:
    return max((p.numel() * 4 for p in module.parameters()), default=0)


def _on_meta(model: nn.Module) -> bool:
    return all(p.is_meta for p in model.parameters())


def _meta_activations(model: BlockModel, spec: ModelSpec, meta: dict[str, Any]) -> list[tuple[float, float]] | None:
    """(saved bytes, output bytes) per block for one sample, or None when the forward fails on meta."""
    params = {id(p) for p in model.parameters()}
    try:
        x = spec.example_inputs(meta, 1).to("meta")
        out = []
        for block in model.blocks.values():
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                base = t._base if t._base is not None else t
                if id(t) not in params and id(base) not in params:
                    saved[id(base)] = base.numel() * base.element_size()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                x = block(x)
            out.append((float(sum(saved.values())), float(x.numel() * x.element_size())))
        return out
    except Exception as e:   # a user's model that needs real values: its activations are not counted
        log.debug(f"activation memory not predicted: the model's forward raised {type(e).__name__} on meta ({e})")
        return None
