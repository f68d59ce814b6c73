"""The layout planner (constraints, cost model, search): partitioning, bubble formulas, validation
messages, memory-driven choices.

Pure arithmetic: no processes, no torch.distributed.
"""

from __future__ import annotations

import itertools
import random

import pytest

from raydl.errors import LayoutError
from raydl.parallel.constraints import validate_layout
from raydl.parallel.cost_model import balanced_cuts, evaluate
from raydl.parallel.profile import BlockProfile, ModelProfile
from raydl.parallel.search import format_table, plan
from raydl.parallel.schedules import NAMES, bubble_fraction

MiB = 2**20


def _block(name="block", fwd=1e-3, bwd=2e-3, params=MiB, act=MiB, out=MiB // 4) -> BlockProfile:
    return BlockProfile(name, fwd_s=fwd, bwd_s=bwd, param_bytes=params, activation_bytes=act, output_bytes=out)


def _uniform(n, **kw) -> ModelProfile:
    block_kw = {k: kw.pop(k) for k in ("fwd", "bwd", "params", "act", "out") if k in kw}
    blocks = tuple(_block(f"b{i}", **block_kw) for i in range(n))
    return ModelProfile(blocks, micro_batch=kw.pop("micro_batch", 4), **kw)


def _part_sums(costs, cuts):
    edges = (0, *cuts, len(costs))
    return [sum(costs[a:b]) for a, b in zip(edges, edges[1:])]


# --- balanced_cuts ------------------------------------------------------------------------------------


def test_balanced_cuts_follow_cost_not_layer_count():
    costs = [1.0] * 8 + [8.0]  # eight light blocks and a head as heavy as all of them
    assert balanced_cuts(costs, 2) == (8,)  # by layer count it would be (4,) or (5,)
    cuts = balanced_cuts(costs, 3)
    assert max(_part_sums(costs, cuts)) == 8.0
    assert cuts[-1] == 8  # the head is a stage of its own


def test_balanced_cuts_match_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.choice([rng.randint(1, 9), rng.random() * 10]) for _ in range(n)]
        cuts = balanced_cuts(costs, k)
        assert len(cuts) == k - 1 and list(cuts) == sorted(set(cuts)) and all(0 < c < n for c in cuts)
        optimum = min(max(_part_sums(costs, c)) for c in itertools.combinations(range(1, n), k - 1))
        assert max(_part_sums(costs, cuts)) == pytest.approx(optimum)


def test_balanced_cuts_rejects_more_stages_than_blocks():
    with pytest.raises(LayoutError, match="3 blocks into 4"):
        balanced_cuts([1, 2, 3], 4)


# --- bubble ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("m", "expected"), [(1, 1 / 2), (2, 1 / 3), (4, 1 / 5), (8, 1 / 9)])
def test_bubble_gpipe_1f1b_two_stages(schedule, m, expected):
    assert bubble_fraction(schedule, 2, m) == pytest.approx(expected)


def test_bubble_other_schedules_and_ordering():
    assert bubble_fraction("interleaved1f1b", 2, 4) == pytest.approx(1 / 9)  # (p-1)/(v*m+p-1), v=2
    assert bubble_fraction("loopedbfs", 2, 4) == pytest.approx(1 / 9)
    assert bubble_fraction("interleavedzb", 2, 4) == pytest.approx(1 / 13)  # (p-1)/(3m+p-1)
    assert bubble_fraction("zbv", 2, 4) == pytest.approx(1 / 17)  # residual calibrated by raydl bench pipeline
    assert bubble_fraction("dualpipev", 4, 8) == pytest.approx(3 / 35)
    # fewer micro-batches than ranks: stages run one after another, as in GPipe
    assert bubble_fraction("interleaved1f1b", 2, 1) == bubble_fraction("zbv", 2, 1) == pytest.approx(1 / 2)
    order = [bubble_fraction(s, 4, 8) for s in ("1f1b", "interleaved1f1b", "interleavedzb", "zbv")]
    assert order == sorted(order, reverse=True) and order[-1] > 0
    assert all(bubble_fraction(s, 1, 3) == 0 for s in NAMES)
    with pytest.raises(LayoutError, match="'nope'"):
        bubble_fraction("nope", 2, 4)


# --- evaluate: time and memory ------------------------------------------------------------------------------


def test_step_time_is_gpipe_formula_plus_transfers():
    free_links = _uniform(4, fwd=1.0, bwd=2.0, p2p_latency_s=0.0, p2p_bytes_per_s=float("inf"))
    layout = evaluate(free_links, world_size=2, pp=2, schedule="gpipe", global_batch=16,
                      device_memory_bytes=2**40)
    assert (layout.num_microbatches, layout.micro_batch, layout.stage_cuts) == (4, 4, (2,))
    assert layout.predicted_step_s == pytest.approx((4 + 2 - 1) * 6.0)  # (m+p-1) * slowest stage
    assert [s.compute_s for s in layout.stages] == pytest.approx([24.0, 24.0])
    # One boundary: both ranks wait 2 transfers (activation, gradient) of latency + bytes/bandwidth.
    slow_links = _uniform(4, fwd=1.0, bwd=2.0, out=100, p2p_latency_s=0.25, p2p_bytes_per_s=400.0)
    layout = evaluate(slow_links, world_size=2, pp=2, schedule="gpipe", global_batch=16, device_memory_bytes=2**40)
    assert layout.predicted_step_s == pytest.approx(5 * (6.0 + 2 * (0.25 + 100 / 400)))


def test_micro_batch_scaling_keeps_total_compute():
    profile = _uniform(4, fwd=1.0, bwd=2.0)
    coarse = evaluate(profile, world_size=2, pp=2, schedule="1f1b", global_batch=16, device_memory_bytes=2**40)
    fine = evaluate(profile, world_size=2, pp=2, schedule="1f1b", global_batch=16, device_memory_bytes=2**40,
                    num_microbatches=8)
    assert fine.micro_batch == 2 and coarse.micro_batch == 4
    assert sum(s.compute_s for s in fine.stages) == pytest.approx(sum(s.compute_s for s in coarse.stages))
    assert fine.predicted_step_s < coarse.predicted_step_s  # smaller bubble with more micro-batches


def test_memory_counts_params_grads_optimizer_and_in_flight_activations():
    profile = _uniform(4, params=10 * MiB, act=MiB, out=0)
    kw = dict(world_size=2, pp=2, global_batch=32, device_memory_bytes=2**40)  # m = 8 micro-batches of 4
    gpipe = evaluate(profile, schedule="gpipe", **kw)
    one_f_one_b = evaluate(profile, schedule="1f1b", **kw)
    static = 2 * 10 * MiB * (2 + 2.0)  # two blocks: params + grads + 2 AdamW states
    assert [s.peak_memory_bytes for s in gpipe.stages] == [static + 8 * 2 * MiB] * 2  # all m in flight
    # 1F1B: rank r keeps min(m, pp - r) micro-batches.
    assert [s.peak_memory_bytes for s in one_f_one_b.stages] == [static + 2 * 2 * MiB, static + 1 * 2 * MiB]
    assert one_f_one_b.predicted_step_s == gpipe.predicted_step_s


def test_fit_is_judged_per_rank():
    profile = _uniform(4, params=10 * MiB, act=MiB, out=0)
    kw = dict(world_size=2, pp=2, schedule="1f1b", global_batch=32)
    needed = 2 * 10 * MiB * 4 + 2 * 2 * MiB
    assert evaluate(profile, device_memory_bytes=needed, **kw).fits
    too_small = evaluate(profile, device_memory_bytes=needed - 1, **kw)
    assert not too_small.fits and "rank 0" in too_small.reason


# --- plan ---------------------------------------------------------------------------------------------


def test_profile_too_big_for_one_device_gets_pipelined():
    profile = _uniform(8, params=100 * MiB, act=8 * MiB)  # 8 x 400 MiB of weights + optimizer states
    chosen, candidates = plan(profile, world_size=4, global_batch=64, device_memory_bytes=2048 * MiB)
    assert chosen.fits and chosen.pp >= 2
    assert all(not c.fits for c in candidates if c.pp == 1)
    assert candidates[0] == chosen and chosen.reason.startswith("chosen")


def test_nothing_fits_says_how_many_workers_would():
    profile = _uniform(8, params=100 * MiB, act=8 * MiB)
    with pytest.raises(LayoutError) as info:
        plan(profile, world_size=2, global_batch=64, device_memory_bytes=1024 * MiB)
    message = str(info.value)
    assert "1,024.0 MiB" in message and "world_size=2" in message
    assert "4 workers would fit" in message  # two blocks (800 MiB) + activations per rank
    assert "activation checkpointing" in message and "saves" in message


def test_single_block_too_big_for_any_worker_count():
    profile = ModelProfile((_block("embed", params=512 * MiB), _block("head")), micro_batch=4)
    with pytest.raises(LayoutError, match="no number helps"):
        plan(profile, world_size=2, global_batch=8, device_memory_bytes=1024 * MiB)


def test_fixed_micro_batch_count_suggests_a_smaller_micro_batch():
    profile = _uniform(2, params=MiB, act=64 * MiB)
    with pytest.raises(LayoutError, match=r"smaller micro-batch: micro_batch=4 fits \(dp=1 pp=1 1f1b m=2"):
        plan(profile, world_size=1, global_batch=8, device_memory_bytes=200 * MiB, num_microbatches=1)


def test_thirty_two_way_plan_is_consistent():
    blocks = [_block("embed", fwd=2e-3, bwd=4e-3, params=400 * MiB, act=8 * MiB)]
    blocks += [_block(f"layer{i}", fwd=4e-3, bwd=8e-3, params=200 * MiB, act=64 * MiB) for i in range(46)]
    blocks += [_block("head", fwd=12e-3, bwd=24e-3, params=400 * MiB, act=128 * MiB)]
    profile = ModelProfile(tuple(blocks), micro_batch=8)
    costs = [b.fwd_s + b.bwd_s for b in blocks]
    chosen, candidates = plan(profile, world_size=32, global_batch=1024, device_memory_bytes=16 * 1024 * MiB)
    assert chosen.fits and chosen.pp > 1  # 48 x 200 MiB x 4 does not fit one 16 GiB device
    for layout in candidates:
        assert layout.dp * layout.pp == 32
        num_stages = len(layout.stages)
        assert num_stages == layout.pp * (1 if layout.schedule in ("gpipe", "1f1b") else 2)
        cuts = layout.stage_cuts
        assert len(cuts) == num_stages - 1 and all(0 < a < b < 48 for a, b in zip(cuts, cuts[1:]))
        # An optimal contiguous split is within one block of a perfect split.
        assert max(_part_sums(costs, cuts)) <= sum(costs) / num_stages + max(costs) + 1e-12
        assert [s.blocks for s in layout.stages][0][0] == 0 and layout.stages[-1].blocks[1] == 48


def test_explicit_stage_cuts_override_balanced_cuts():
    profile = _uniform(8)
    kw = dict(world_size=2, global_batch=16, device_memory_bytes=2**40, pp=2, schedule="1f1b")
    balanced, _ = plan(profile, **kw)
    manual, candidates = plan(profile, stage_cuts=(2,), **kw)
    assert balanced.stage_cuts == (4,)
    assert manual.stage_cuts == (2,) and all(c.stage_cuts == (2,) for c in candidates)
    assert [s.blocks for s in manual.stages] == [(0, 2), (2, 8)]
    assert manual.predicted_step_s > balanced.predicted_step_s
    assert evaluate(profile, world_size=2, pp=2, schedule="1f1b", global_batch=16, device_memory_bytes=2**40,
                    stage_cuts=(6,)).stage_cuts == (6,)


def test_explicit_arguments_restrict_and_are_validated():
    profile = _uniform(8)
    kw = dict(world_size=4, global_batch=32, device_memory_bytes=2**40)
    _, candidates = plan(profile, pp=2, schedule="interleavedzb", **kw)
    assert {(c.pp, c.schedule) for c in candidates} == {(2, "interleavedzb")}
    chosen, candidates = plan(profile, pp=2, schedule="gpipe", num_microbatches=4, **kw)
    assert len(candidates) == 1 and (chosen.micro_batch, chosen.dp) == (4, 2)
    with pytest.raises(LayoutError, match="world_size=4 is not divisible by pp=3"):
        plan(profile, pp=3, **kw)
    with pytest.raises(LayoutError, match="'pipedream'"):
        plan(profile, schedule="pipedream", **kw)
    with pytest.raises(LayoutError, match="num_microbatches=1 < pp=2"):
        plan(profile, pp=2, schedule="1f1b", num_microbatches=1, world_size=2, global_batch=4,
             device_memory_bytes=2**40)


def test_ties_prefer_1f1b_over_gpipe_and_auto_pp1_is_listed_once():
    # Slow links: the 2-stage-per-rank schedules wait on twice the boundaries, so 1f1b and gpipe lead.
    profile = _uniform(8, p2p_latency_s=1.0)
    chosen, candidates = plan(profile, world_size=2, global_batch=16, device_memory_bytes=2**40, pp=2,
                              num_microbatches=4)
    by_schedule = {c.schedule: c for c in candidates}
    assert by_schedule["gpipe"].predicted_step_s == chosen.predicted_step_s
    assert chosen.schedule == "1f1b" and candidates[1].schedule == "gpipe"
    assert "tie-break" in by_schedule["gpipe"].reason
    _, candidates = plan(profile, world_size=2, global_batch=16, device_memory_bytes=2**40, pp=1)
    assert {c.schedule for c in candidates} == {"1f1b"}


def test_format_table_marks_the_chosen_row():
    chosen, candidates = plan(_uniform(8), world_size=4, global_batch=32, device_memory_bytes=2**40)
    table = format_table(candidates, chosen).splitlines()
    assert table[0].split()[:4] == ["dp", "pp", "schedule", "m"]
    assert len(table) == len(candidates) + 2
    marked = [line for line in table[1:-1] if line.startswith("*")]
    assert len(marked) == 1 and chosen.schedule in marked[0]
    assert table[-1].startswith("*") and "chosen: lowest predicted step time" in table[-1]


# --- validate_layout ---------------------------------------------------------------------------------------

_GOOD = dict(num_blocks=8, world_size=4, pp=2, schedule="1f1b", num_microbatches=4, global_batch=16, micro_batch=2)


def test_validate_accepts_a_good_layout():
    assert validate_layout(**_GOOD) is None   # raises LayoutError otherwise
    assert validate_layout(**{**_GOOD, "schedule": "zbv", "stage_cuts": (2, 4, 6)}) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"schedule": "foo"}, ["'foo'", "gpipe, 1f1b"]),
        ({"pp": 0}, ["pp=0"]),
        ({"pp": 3}, ["world_size=4", "pp=3", "{1, 2, 4}"]),
        ({"num_blocks": 1, "world_size": 2}, ["pp=2", "2 stages", "only 1 blocks", "pp <= 1"]),
        ({"num_blocks": 3, "schedule": "zbv"}, ["4 stages (2 per rank)", "only 3 blocks", "pp <= 1"]),
        ({"global_batch": 18}, ["global_batch=18", "2*2 = 4", "e.g. 20"]),
        ({"num_microbatches": 3}, ["16/2 = 8", "3*2 = 6", "num_microbatches=4"]),
        ({"micro_batch": 0, "num_microbatches": 9}, ["micro_batch=0", "num_microbatches=9", "<= 8"]),
        ({"world_size": 2, "global_batch": 2, "micro_batch": 2, "num_microbatches": 1},
         ["num_microbatches=1 < pp=2", "gpipe"]),
        ({"schedule": "interleaved1f1b", "num_microbatches": 5, "global_batch": 20, "micro_batch": 2},
         ["max(1, num_microbatches // pp) = 2", "num_microbatches=5", "pp=2"]),
        ({"schedule": "interleavedzb", "num_microbatches": 5, "global_batch": 20, "micro_batch": 2},
         ["= 2", "num_microbatches=5"]),
        ({"schedule": "dualpipev", "num_microbatches": 3, "global_batch": 12}, ["2*pp = 4", "num_microbatches=3"]),
        ({"stage_cuts": (2, 4)}, ["(2, 4)", "2 cuts", "pp=2", "need 1"]),
        ({"schedule": "zbv", "stage_cuts": (4,)}, ["1 cuts", "2 stage(s) per rank", "4 stages need 3"]),
        ({"stage_cuts": (8,)}, ["cut 8", "1..7"]),
        ({"stage_cuts": (0,)}, ["cut 0", "1..7"]),
        ({"schedule": "loopedbfs", "stage_cuts": (2, 2, 5)}, ["(2, 2, 5)", "cut 2 at position 1 follows 2"]),
        ({"schedule": "loopedbfs", "stage_cuts": (5, 3, 6)}, ["cut 3 at position 1 follows 5"]),
    ],
)
def test_validate_rejects_with_numbers(change, expected):
    with pytest.raises(LayoutError) as info:
        validate_layout(**{**_GOOD, **change})
    for fragment in expected:
        assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
