"""The state holder's decisions (which step a restarted group reloads, what it keeps, whose shards it refuses) and
the shard copy in and out of a model and optimizer: no processes."""

from __future__ import annotations

import torch

from raydl.train.memory_state import load_shard, take_shard
from raydl.train.state_holder import StateHolder

PP2 = {"world_size": 2, "dp": 1, "pp": 2, "num_microbatches": 2, "micro_batch": 32, "schedule": "1f1b",
       "stage_cuts": [], "dp_wrapper": "replicate", "dp_wrapper_reason": "fits"}
DP2 = {**PP2, "dp": 2, "pp": 1, "schedule": "", "dp_wrapper": "ddp"}


def shard(step: int) -> dict:
    return {"trainer": {"step": step}, "model": {"w": torch.full((3,), float(step))}}


def test_a_restarted_group_reloads_the_newest_step_every_rank_handed_over():
    h = StateHolder()
    g = h.begin_group(PP2)["generation"]
    for step in (1, 2):
        for rank in (0, 1):
            assert h.put(g, rank, step, PP2, shard(step))
    h.put(g, 0, 3, PP2, shard(3))         # rank 1 died before handing step 3 over
    answer = h.begin_group(PP2)
    assert (answer["step"], answer["source_generation"]) == (2, g)
    assert h.get(g, 2, 1)["model"]["w"].tolist() == [2.0] * 3
    assert h.held()["entries"] == {f"{g}/2": [0, 1], f"{g}/3": [0]}   # step 1 dropped once 2 was complete


def test_no_step_is_reloadable_when_the_ranks_never_agreed_or_the_layout_changed():
    h = StateHolder()
    g = h.begin_group(PP2)["generation"]
    h.put(g, 0, 1, PP2, shard(1))
    first = h.begin_group(PP2)
    assert first["step"] is None and "no complete step" in first["why"]
    g = first["generation"]
    h.put(g, 0, 5, PP2, shard(5))
    h.put(g, 1, 5, PP2, shard(5))
    resized = h.begin_group(DP2)
    assert resized["step"] is None and "another layout" in resized["why"]


def test_replicas_send_once_and_reload_their_stages_copy_while_fsdp_shards_all_count():
    h = StateHolder()
    g = h.begin_group(DP2)["generation"]
    h.put(g, 0, 3, DP2, shard(3))                       # DDP: data-parallel rank 0 alone sends
    answer = h.begin_group(DP2)
    assert answer["step"] == 3
    assert h.get(answer["source_generation"], 3, 1)["model"]["w"].tolist() == [3.0] * 3   # rank 1: rank 0's copy
    fsdp, h = {**DP2, "dp_wrapper": "fsdp"}, StateHolder()
    g = h.begin_group(fsdp)["generation"]
    h.put(g, 0, 4, fsdp, shard(4))
    assert "no complete step" in h.begin_group(fsdp)["why"]   # rank 1's shard is its own: step 4 is incomplete


def test_shards_of_a_group_that_was_replaced_are_refused():
    h = StateHolder()
    old = h.begin_group(PP2)["generation"]
    new = h.begin_group(PP2)["generation"]
    assert not h.put(old, 0, 7, PP2, shard(7))    # a dead worker's send that arrived late
    assert h.put(new, 0, 7, PP2, shard(7))
    assert h.held()["entries"] == {f"{new}/7": [0]}


def test_the_holder_keeps_its_own_copy_of_the_tensors():
    h = StateHolder()
    g = h.begin_group(PP2)["generation"]
    sent = shard(4)
    h.put(g, 0, 4, PP2, sent)
    sent["model"]["w"].zero_()            # the sender's buffer reused (or freed with it)
    assert h.get(g, 4, 0)["model"]["w"].tolist() == [4.0] * 3
    assert h.held()["bytes"] == 3 * 4


def test_a_shard_taken_after_a_step_loads_back_into_a_fresh_model_and_optimizer():
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, x):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    for _ in range(3):
        step(model, opt, torch.randn(5, 4))
    held = take_shard(model, opt)
    x = torch.randn(5, 4)
    step(model, opt, x)                  # the live tensors change in place; the held copy must not
    assert not torch.equal(held["model"]["0.weight"], model[0].weight)

    fresh, fresh_opt = build()           # a restarted worker: new model and optimizer, the held state loaded
    load_shard(fresh, fresh_opt, held)
    step(fresh, fresh_opt, x)            # redo the step: bit-identical, moments and step count included
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["step"].item() == 4.0
