"""How a global batch splits over data-parallel replicas and micro-batches: the arithmetic every layout shares
(raydl.parallel.mesh's layouts, the memory refusal's alternatives, the survivors path at each size)."""

from __future__ import annotations

import math
import warnings

from raydl.errors import LayoutError


def batch_split(*, global_batch: int, micro_batch: int, dp: int, strict: bool,
                num_microbatches: int = 0) -> tuple[int, int]:
    """(micro_batch, num_microbatches) with dp × m × micro == global_batch, exactly if possible.

    With `strict` (a fixed-size run) an inexact split is an error; in an elastic run the
    closest smaller global batch is used and a warning gives the numbers.
    """
    per_replica = global_batch // dp
    if num_microbatches:
        m = num_microbatches
    else:   # fewest micro-batches of at most micro_batch samples that cover the most of per_replica
        first = max(1, math.ceil(per_replica / micro_batch))
        m = max(range(first, max(first, per_replica) + 1), key=lambda k: (k * (per_replica // k), -k))
    micro = per_replica // m
    if micro == 0:
        raise LayoutError(f"parallel.num_microbatches={m} is more than the {per_replica} samples each of the {dp} "
                          f"replicas gets per step. Fix: lower parallel.num_microbatches or raise train.global_batch_size.")
    effective = dp * m * micro
    if effective != global_batch:
        msg = (f"train.global_batch_size={global_batch} cannot be split exactly over {dp} data-parallel replicas "
               f"with micro-batches of at most {micro_batch} ({m} x {micro} per replica)")
        if strict:
            raise LayoutError(f"{msg}. Fix: make train.global_batch_size a multiple of "
                              f"{dp} x train.micro_batch_size (e.g. {dp * m * micro_batch}), or change the workers.")
        warnings.warn(f"{msg}; training with a global batch of {effective} while the world size is "
                      f"{dp} replicas (it returns to {global_batch} when the world size allows).", stacklevel=2)
    return micro, m
