"""Packed rows through a pipeline: at pp=2 (2 gloo ranks, 4 micro-batches; 1F1B for raydl's gpt, ZBV for the
Hugging Face Llama blocks: two stages on each rank) every stage gets its micro-batch's document ids, so one step's
loss and gradients and the evaluation's loss equal pp=1's to 1e-5. The batch is what the loader gives for packed
rows (raydl.data.loader.to_tensors: padded to seq_len with masks), and the documents matter: the same rows
unmasked give another loss."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from raydl.data.loader import to_tensors
from raydl.overrides import load_config
from tests.helpers import engine_on_this_rank, run_gloo

VOCAB, SEQ, ROWS = 40, 24, 8
META = {"vocab_size": VOCAB, "seq_len": SEQ}
MODELS = {"gpt": ("model.size=tiny",),
          "llama": ("model.name=hf", "model.options.hidden_size=32", "model.options.num_hidden_layers=2")}
SCHEDULES = {"gpt": "1f1b", "llama": "zbv"}


def packed_batch(*, documents: bool = True) -> dict[str, torch.Tensor]:
    """8 rows of 1-4 records each (as prepare --pack writes them), padded by the loader."""
    g = torch.Generator().manual_seed(5)
    inputs, labels, docs = [], [], []
    for row in range(ROWS):
        lengths = torch.randint(2, 8, (1 + row % 4,), generator=g).tolist()
        ids = torch.randint(1, VOCAB, (sum(lengths),), generator=g).tolist()
        inputs.append(ids)
        labels.append([t if i % 3 else -100 for i, t in enumerate(ids[1:] + [ids[0]])])
        docs.append([d for d, n in enumerate(lengths) for _ in range(n)])
    table = {"input_ids": inputs, "labels": labels, **({"document_ids": docs} if documents else {})}
    return to_tensors(pa.table({k: pa.array(v, pa.list_(pa.int32())) for k, v in table.items()}), META)


def _step(rank: int, world_size: int, model: str, sets: tuple[str, ...], documents: bool) -> dict:
    cfg = load_config(None, [*MODELS[model], f"train.global_batch_size={ROWS}", "train.micro_batch_size=2", *sets])
    engine, layout = engine_on_this_rank(cfg, META, rank, world_size)
    batch = packed_batch(documents=documents)
    stats = engine.forward_backward(batch, scaler=None)
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).tolist()
             for name, p in engine.model.named_parameters()}
    evaluation = engine.evaluate([batch], precision="fp32")
    return {"pp": layout.pp, "loss": float(stats.loss) if stats.has_loss else None, "grads": grads,
            "eval": evaluation["loss"]}


def _pp2(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    pp2 = ("parallel.pp_degree=2", "parallel.num_microbatches=4")
    results = {model: _step(rank, world_size, model, (*pp2, f"parallel.schedule={SCHEDULES[model]}"), True)
               for model in MODELS}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_gives_a_packed_batch_the_loss_and_gradients_of_pp1(tmp_path):
    torch.set_num_threads(1)
    run_gloo(_pp2, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for model in MODELS:
        reference = _step(0, 1, model, ("parallel.pp_degree=1",), True)
        unmasked = _step(0, 1, model, ("parallel.pp_degree=1",), False)
        assert abs(unmasked["loss"] - reference["loss"]) > 1e-3, model    # the documents change what is computed
        assert [r[model]["pp"] for r in ranks] == [2, 2]
        losses = [r[model]["loss"] for r in ranks if r[model]["loss"] is not None]
        assert len(losses) == 1 and abs(losses[0] - reference["loss"]) < 1e-5, (model, losses, reference["loss"])
        assert all(abs(r[model]["eval"] - reference["eval"]) < 1e-5 for r in ranks), model
        seen = set()
        for r in ranks:
            for name, grad in r[model]["grads"].items():
                torch.testing.assert_close(torch.tensor(grad), torch.tensor(reference["grads"][name]), rtol=0,
                                           atol=1e-5, msg=f"{model} {name}")
                seen.add(name)
        assert seen == set(reference["grads"]), model
