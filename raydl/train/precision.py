"""Mixed precision: autocast context and (for fp16) the gradient scaler."""

from __future__ import annotations

import contextlib

import torch

# fp8: bf16 autocast around the float8 matmuls (raydl.parallel.float8), as torchtitan trains float8 under bf16
# mixed precision.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    # bf16 has fp32's exponent range, so only fp16 needs loss scaling against underflow.
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
