"""Token-weighted loss: one step's gradients equal the full batch's (sum over its target tokens / their count)
whatever the split: 1 worker x 8 rows x 1 micro-batch, 2 gloo ranks x 2 rows x 2 micro-batches, 1 worker x 1 row
x 8 micro-batches, and pp=2; on records of mixed lengths whose labels are -100 on padding and on a prompt of varying
length, so rows and micro-batches hold different counts of targets (a per-rank or per-micro-batch mean would
weigh their tokens differently and miss by far more than 1e-6)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import raydl.models.loss
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.train.model_build import build_for_worker
from tests.helpers import engine_on_this_rank, run_gloo

VOCAB, SEQ, ROWS = 40, 12, 8
META = {"vocab_size": VOCAB, "seq_len": SEQ}


def records() -> dict[str, torch.Tensor]:
    """8 rows of different lengths (padded with token 0) and prompts: labels only on each row's response."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.roll(-1, dims=1).clone()
    lengths, prompts = [12, 5, 9, 3, 12, 7, 10, 4], [2, 0, 6, 1, 9, 3, 0, 2]
    for row, (length, prompt) in enumerate(zip(lengths, prompts)):
        ids[row, length:] = 0
        labels[row, length - 1:] = -100
        labels[row, :prompt] = -100
    return {"input_ids": ids, "labels": labels}


def reference(cfg) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, unsplit: mean cross-entropy over every target token of the batch, logits whole."""
    chosen = choose_model(cfg.model)
    model, init = build_for_worker(chosen, META, cfg)
    init(model, torch.device("cpu"))
    batch = records()
    loss = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def _config(*sets: str):
    return load_config(None, ["model.size=tiny", f"train.global_batch_size={ROWS}", *sets])


def _one_step(rank: int, world_size: int, case: str, sets: tuple[str, ...], out: str) -> None:
    cfg = _config(*sets)
    engine, layout = engine_on_this_rank(cfg, META, rank, world_size)
    dp_rank, rows = layout.coords(rank)[0], ROWS // layout.dp
    mine = {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in records().items()}
    stats = engine.forward_backward(mine, scaler=None)
    grads = {}
    for name, p in engine.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.removeprefix("module.")] = g.tolist()
    loss = float(stats.loss) if stats.has_loss else None
    with open(f"{out}/{case}.rank{rank}.json", "w") as f:
        json.dump({"layout": [layout.dp, layout.pp, layout.micro_batch, layout.num_microbatches], "loss": loss,
                   "grads": grads}, f)


def _cases(rank: int, world_size: int, cases: list[str], out: str) -> None:
    torch.set_num_threads(1)
    raydl.models.loss.CHUNK_TOKENS = 5   # several chunks per micro-batch, one cut mid-row
    for case in cases:
        _one_step(rank, world_size, case, {**CASES, **TIED_CASES}[case][1], out)


CASES = {   # name: (world size, overrides, expected (dp, pp, rows per micro-batch, micro-batches))
    "1x8x1": (1, ("train.micro_batch_size=8",), [1, 1, 8, 1]),
    "1x1x8": (1, ("train.micro_batch_size=1",), [1, 1, 1, 8]),
    "2x2x2 fsdp": (2, ("train.micro_batch_size=2", "parallel.dp_wrapper=fsdp"), [2, 1, 2, 2]),
    "2x2x2 ddp": (2, ("train.micro_batch_size=2", "parallel.dp_wrapper=ddp"), [2, 1, 2, 2]),
    "pp2": (2, ("train.micro_batch_size=2", "parallel.pp_degree=2", "parallel.schedule=1f1b",
                "parallel.num_microbatches=4"), [1, 2, 2, 4]),
}
TIED = ("model.options.tie_head=true",)   # gpt2's head: one weight, or a copy per stage kept equal
TIED_CASES = {
    "2x2x2 fsdp tied": (2, (*CASES["2x2x2 fsdp"][1], *TIED), [2, 1, 2, 2]),
    "pp2 tied": (2, (*CASES["pp2"][1], *TIED), [1, 2, 2, 4]),
    "zbv tied": (2, ("train.micro_batch_size=2", "parallel.pp_degree=2", "parallel.schedule=zbv",
                     "parallel.num_microbatches=4", *TIED), [1, 2, 2, 4]),   # both copies on rank 0
}


def _check(out, cases: dict, full_loss: float, reference_grads: dict[str, torch.Tensor], tied: dict[str, str]):
    for case, (world_size, _, expected) in cases.items():
        seen: set[str] = set()
        losses = []
        for rank in range(world_size):
            result = json.loads((out / f"{case}.rank{rank}.json").read_text())
            assert result["layout"] == expected, (case, result["layout"])
            losses += [result["loss"]] if result["loss"] is not None else []
            for name, grad in result["grads"].items():
                name = tied.get(name, name)   # a pipeline's copy of a tied weight: the whole weight's gradient
                grad, ref = torch.tensor(grad), reference_grads[name]
                relative = float((grad - ref).norm() / ref.norm())
                assert relative < 1e-6, (case, rank, name, relative)
                seen.add(name)
        assert seen == set(reference_grads), (case, set(reference_grads) - seen)
        # the step's loss as the loop reports it: the mean over the ranks that have one
        assert abs(sum(losses) / len(losses) - full_loss) < 1e-6 * full_loss, (case, losses, full_loss)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gradients_equal_the_full_batch_at_every_split(tmp_path):
    full_loss, reference_grads = reference(_config("train.micro_batch_size=8"))
    tied_loss, tied_grads = reference(_config("train.micro_batch_size=8", *TIED))
    batch = records()
    counts = (batch["labels"] != -100).sum(1)
    assert len(set(counts.tolist())) > 4, counts   # rows hold different counts of targets
    _cases(0, 1, [c for c, (size, _, _) in CASES.items() if size == 1], str(tmp_path))
    run_gloo(_cases, 2, [c for c, (size, _, _) in {**CASES, **TIED_CASES}.items() if size == 2], str(tmp_path))
    _check(tmp_path, CASES, full_loss, reference_grads, {})
    assert "blocks.head.out.weight" not in tied_grads   # one weight
    _check(tmp_path, TIED_CASES, tied_loss, tied_grads, {"blocks.head.out.weight": "blocks.embed.tok.weight"})
