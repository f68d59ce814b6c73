"""The gpt2 preset is GPT-2 124M as nanoGPT has it (bias=True): head tied, vocabulary padded to 50304; a checkpoint
of the earlier untied gpt2 is refused with the way back (model.options.tie_head=false builds that model again)."""

from __future__ import annotations

import pytest
import torch

from raydl.errors import CheckpointError
from raydl.models.build import SkipWeightInit
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.train.checkpoint import check_compatible

META = {"vocab_size": 50257, "seq_len": 1024}


def _fingerprint(*sets: str) -> dict:
    chosen = choose_model(load_config(None, ["model.size=gpt2", *sets]).model)
    with torch.device("meta"), SkipWeightInit():
        model = chosen.build(META)
    return chosen.fingerprint(model), model


def test_gpt2_has_gpt2_124m_parameters_and_one_head_weight():
    fingerprint, model = _fingerprint()
    head, embed = model.blocks["head"].out, model.blocks["embed"]
    assert head.weight is embed.tok.weight and embed.tok.weight.shape == (50304, 768)
    assert fingerprint["params"] == 124_475_904                               # nanoGPT: 123.69M without wpe
    assert fingerprint["params"] - embed.pos.weight.numel() == 123_689_472


def test_an_untied_gpt2_checkpoint_is_refused_with_the_option_that_builds_it_again():
    old = {"name": "gpt", "size": "gpt2", "params": 163_037_184, "blocks": 14}   # before 2026-11-27
    untied, _ = _fingerprint("model.options.tie_head=false")
    assert untied == old
    with pytest.raises(CheckpointError, match="tie_head=false"):
        check_compatible({"model": old}, _fingerprint()[0], "runs/old/train/step_00000100")
    check_compatible({"model": old}, untied, "runs/old/train/step_00000100")
