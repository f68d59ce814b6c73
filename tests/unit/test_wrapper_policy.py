"""parallel.dp_wrapper=auto chooses per layout from the model's size and the device's memory, and says why."""

from __future__ import annotations

import pytest

from raydl.errors import LayoutError
from raydl.overrides import load_config
from raydl.parallel.mesh import layout_for
from raydl.parallel.wrapper_policy import choose_dp_wrapper

GIB = 2**30


@pytest.mark.parametrize("dp, pp, param_gib, memory_gib, wrapper", [
    (1, 1, 1, 80, "none"),          # no replicas
    (2, 1, 1, 80, "ddp"),           # 4 GiB of state in 80: unsharded, one all-reduce
    (2, 2, 1, 80, "replicate"),     # fits, but classic DDP is wrong with pipelines
    (2, 1, 20, 80, "fsdp"),         # 80 GiB of state > half of 80
    (4, 2, 30, 80, "fsdp"),         # 60 GiB per rank with pp=2 > 40
    (4, 4, 30, 80, "replicate"),    # 30 GiB per rank with pp=4 <= 40
])
def test_auto_picks_by_memory_and_pipeline(dp, pp, param_gib, memory_gib, wrapper):
    chosen, why = choose_dp_wrapper("auto", dp=dp, pp=pp, param_bytes=param_gib * GIB, memory_bytes=memory_gib * GIB)
    assert chosen == wrapper and why


def test_an_explicit_wrapper_is_kept_and_said_so():
    assert choose_dp_wrapper("fsdp", dp=2, pp=1, param_bytes=GIB, memory_bytes=80 * GIB) == \
        ("fsdp", "set by parallel.dp_wrapper")


def test_layout_records_the_choice_and_ddp_with_pipelines_stays_refused():
    layout = layout_for(load_config(None, ["scaling.min_workers=2"]), 2, num_blocks=6,
                                param_bytes=4 * 2**20, memory_bytes=8 * GIB)
    assert layout.dp_wrapper == "ddp" and "MiB" in layout.dp_wrapper_reason
    assert layout.to_dict()["dp_wrapper"] == "ddp"
    piped = layout_for(load_config(None, ["parallel.pp_degree=2", "parallel.num_microbatches=4", "scaling.max_workers=4",
                                                  "scaling.min_workers=4"]), 4, num_blocks=6,
                               param_bytes=4 * 2**20, memory_bytes=8 * GIB)
    assert (piped.dp, piped.pp, piped.dp_wrapper) == (2, 2, "replicate")
    with pytest.raises(LayoutError, match="dp_wrapper=ddp does not work with pipeline"):
        layout_for(load_config(None, ["parallel.pp_degree=2", "parallel.num_microbatches=4", "parallel.dp_wrapper=ddp",
                                              "scaling.max_workers=4", "scaling.min_workers=4"]), 4, num_blocks=6)
