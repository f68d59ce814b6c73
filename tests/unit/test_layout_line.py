"""The layout line rank 0 logs at every worker-group start: one sentence for people, built from a real Layout."""

from __future__ import annotations

from raydl.overrides import load_config
from raydl.parallel.layout import Layout, describe
from raydl.parallel.mesh import layout_for

GIB = 2**30
PARAM_BYTES = 3_200_000   # 0.80M fp32 params: 12 MiB with grads and two Adam states


def _layout(workers: int, *sets: str, memory_bytes: int = 8 * GIB) -> Layout:
    cfg = load_config(None, [f"scaling.min_workers={workers}", f"scaling.max_workers={workers}", *sets])
    return layout_for(cfg, workers, num_blocks=6, param_bytes=PARAM_BYTES, memory_bytes=memory_bytes)


def test_data_parallel_names_the_wrapper_and_why():
    assert describe(_layout(2), start_step=0, num_params=800_000) == (
        "2 workers: data-parallel × 2 (DDP: params + grads + optimizer states 12 MiB per rank fit in 50% of "
        "8,192 MiB per device), micro-batch 32, no pipeline, from step 0, 0.80M params")


def test_one_worker_with_accumulation():
    line = describe(_layout(1), start_step=1200, num_params=800_000)
    assert line == ("1 worker: no data parallelism, 2 micro-batches of 32 accumulated per step, no pipeline, "
                    "from step 1200, 0.80M params")


def test_a_model_that_does_not_fit_is_sharded_and_says_so():
    line = describe(_layout(2, memory_bytes=16 * 2**20), start_step=0, num_params=800_000)
    assert "(FSDP2 fully_shard: params + grads + optimizer states 12 MiB per rank exceed 50% of 16 MiB" in line


def test_pipeline_with_data_parallelism():
    line = describe(_layout(4, "parallel.pp_degree=2", "parallel.num_microbatches=4"), start_step=0,
                    num_params=800_000)
    assert line.startswith("4 workers: data-parallel × 2 (FSDP2 replicate: params + grads + optimizer states 6 MiB")
    assert "× pipeline × 2 (schedule 1f1b, 4 micro-batches of 8), from step 0" in line
    assert "no pipeline" not in line and "micro-batch 8" not in line


def test_pipeline_alone_with_manual_cuts():
    line = describe(_layout(2, "parallel.pp_degree=2", "parallel.num_microbatches=4", "parallel.stage_cuts=[3]"),
                    start_step=0, num_params=800_000)
    assert line == ("2 workers: pipeline × 2 (schedule 1f1b, 4 micro-batches of 16, later stages start at blocks 3), "
                    "from step 0, 0.80M params")
