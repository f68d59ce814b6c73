"""parallel.dp_wrapper=auto: which data-parallel wrapper a layout trains with, and why.

A policy, pure: the engine applies what it decides. Sharding (FSDP2) buys memory and costs
collectives per block (an all-gather forward and backward, a reduce-scatter per block); when the
unsharded model, its gradients and its optimizer states fit comfortably on every device it buys
nothing. Measured here, 200 steps of the default model at dp=2 under Ray: fsdp 436 samples/s,
replicate 623, ddp 990; one worker alone 1,028. So: classic DDP (one bucketed all-reduce per step)
when the model fits and pp = 1; FSDP2's `replicate` when it fits and pp > 1 (classic DDP is wrong
with pipeline schedules); `fully_shard` when it does not fit.
"""

from __future__ import annotations

from typing import Callable

# Unsharded training state may take at most this share of a device: activations, the allocator's
# slack and the framework need the rest.
FIT_SHARE = 0.5
_MIB = 2**20
# What each wrapper is called where people read it (the layout line).
WRAPPER_NAMES = {"ddp": "DDP", "replicate": "FSDP2 replicate", "fsdp": "FSDP2 fully_shard"}


def choose_dp_wrapper(requested: str, *, dp: int, pp: int, param_bytes: int, memory_bytes: int,
                      optimizer_bytes_per_param_byte: float = 2.0,
                      predicted: Callable[[str], int] | None = None, in_backward: bool = False) -> tuple[str, str]:
    """(wrapper, why) for one worker group: "none" without data parallelism, else ddp, replicate or fsdp.

    `predicted(wrapper)`: the fullest worker's predicted peak with that wrapper (`raydl.parallel.memory`, the
    process included); with it, the unsharded wrapper is chosen when its whole peak fits the memory per worker.
    Without it, params + grads + optimizer states must fit in FIT_SHARE of it.
    `in_backward` (train.optimizer_in_backward): fully_shard, the wrapper that reduces each gradient before its
    parameter's step hook runs.
    `why` is a phrase for people that goes after the wrapper's name ("DDP: params + grads + ... fit in ...").
    """
    if dp == 1:
        return "none", "one data-parallel replica: no wrapper"
    if requested != "auto":
        return requested, "set by parallel.dp_wrapper"
    if in_backward:
        return "fsdp", "train.optimizer_in_backward: fully_shard calls the step when a gradient is reduced"
    unsharded = "ddp" if pp == 1 else "replicate"
    if predicted is not None and memory_bytes:
        need = predicted(unsharded)
        fits = need <= memory_bytes
        sizes = (f"predicted peak {need / _MIB:,.0f} MiB per worker unsharded {'fits in' if fits else 'exceeds'} "
                 f"{memory_bytes / _MIB:,.0f} MiB")
        return _pick(fits, pp, sizes)
    per_rank = param_bytes / pp * (2 + optimizer_bytes_per_param_byte)   # params + grads + optimizer states
    if not param_bytes or not memory_bytes:
        fits, sizes = True, "model or device size unknown, taken to fit"
    else:
        fits = per_rank <= FIT_SHARE * memory_bytes
        sizes = (f"params + grads + optimizer states {per_rank / _MIB:,.0f} MiB per rank "
                 f"{'fit in' if fits else 'exceed'} {FIT_SHARE:.0%} of {memory_bytes / _MIB:,.0f} MiB per device")
    return _pick(fits, pp, sizes)


def _pick(fits: bool, pp: int, sizes: str) -> tuple[str, str]:
    if not fits:
        return "fsdp", sizes
    if pp == 1:
        return "ddp", sizes
    return "replicate", f"{sizes}; classic DDP is wrong with pipeline schedules"
