"""model.name=hf built on meta by workers: initial weights (transformers' init, seeded by name) and weights read
from a save_pretrained directory are equal to the bit at pp=2, dp=2 (FSDP2: each rank reads its rows) and dp=1,
the embeddings' (and head's) files in bf16 (read into the fp32 parameters chunk by chunk), and a pipeline rank holds no tensor
of another stage. One spawned gloo group builds every case."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from raydl.models.hf.model import build_causal_lm
from raydl.models.hf.options import HfOptions
from tests.dist.test_meta_build import _build as build_meta
from tests.dist.test_meta_build import _own_bytes, _real_blocks, _state, _storage_bytes
from tests.helpers import run_gloo

META = {"vocab_size": 61, "seq_len": 8, "eos": 60}   # 61 rows: FSDP2 shards the embedding and the head unevenly
RANDOM = ("model.name=hf", "model.options.family=llama", "model.options.layers=3", "model.options.hidden_size=32",
          "model.options.kv_heads=2", "model.options.tie_word_embeddings=true")
LAYOUTS = {"pp2": ("parallel.pp_degree=2", "parallel.schedule=1f1b"), "dp2": ("parallel.dp_wrapper=fsdp",)}
COMMON = ("train.global_batch_size=4", "train.micro_batch_size=2", "train.seed=3")


def _build(model_sets: tuple[str, ...], sets: tuple[str, ...], rank: int, world_size: int, watch=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the untie warning
        return build_meta(sets, rank, world_size, watch, common=(*COMMON, *model_sets), meta=META)


def _ranks(rank: int, world_size: int, out_dir: str, weights: str) -> None:
    for source, model_sets in (("random", RANDOM), ("weights", ("model.name=hf", f"model.options.weights={weights}"))):
        for name, sets in LAYOUTS.items():
            seen: list[set[str]] = []
            engine, built = _build(model_sets, sets, rank, world_size,
                                   watch=lambda blocks: seen.append(_real_blocks(blocks)))
            if name == "pp2":
                mine = set(engine.model.blocks)
                assert seen and all(real <= mine for real in seen), (source, rank, mine, seen)
                assert _storage_bytes(engine.model) == _own_bytes(engine.model), source
            torch.save(_state(engine), Path(out_dir) / f"{source}-{name}.{rank}.pt")


def _save_weights(folder: Path) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_causal_lm(HfOptions(family="llama", num_hidden_layers=3, hidden_size=32, num_key_value_heads=2,
                                          config_fields={"tie_word_embeddings": True}), META)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.config.tie_word_embeddings = True
    model.save_pretrained(folder, max_shard_size="30KB")
    where = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in {folder / where[k] for k in ("model.embed_tokens.weight", "lm_head.weight") if k in where}:
        save_file({k: v.bfloat16() for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_initial_and_loaded_weights_are_equal_to_the_bit_in_every_layout(tmp_path):
    _save_weights(tmp_path / "saved")
    run_gloo(_ranks, 2, str(tmp_path), str(tmp_path / "saved"))
    for source, model_sets in (("random", RANDOM), ("weights", ("model.name=hf",
                                                                 f"model.options.weights={tmp_path / 'saved'}"))):
        engine, _ = _build(model_sets, (), 0, 1)
        reference = _state(engine)
        assert torch.equal(reference["blocks.head.lm_head.weight"], reference["blocks.embed.embed_tokens.weight"])
        for name in LAYOUTS:
            ranks = [torch.load(tmp_path / f"{source}-{name}.{r}.pt", weights_only=True) for r in range(2)]
            if name == "pp2":
                assert not ranks[0].keys() & ranks[1].keys(), source   # a stage holds only its own tensors
            merged = {**ranks[0], **ranks[1]}
            assert merged.keys() == reference.keys(), (source, name)
            different = [k for k in reference if any(k in got and not torch.equal(got[k], reference[k])
                                                     for got in ranks)]
            assert not different, (source, name, different)
