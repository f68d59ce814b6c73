"""The memory prediction (raydl.parallel.memory), pure: what each layout, precision and optimizer puts on a worker,
and the refusal of a layout that cannot fit, with its numbers and the layouts that would."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raydl.config import JobConfig
from raydl.errors import LayoutError
from raydl.models.build import SkipWeightInit
from raydl.models.gpt import build_gpt, gpt_blocks, spec as gpt_spec
from raydl.models.loss import chunk_bytes
from raydl.parallel import memory
from raydl.overrides import load_config
from raydl.parallel.memory import RUNTIME_BYTES, BlockMemory, ModelMemory, Setting, build_bytes, predict
from raydl.parallel.memory_probe import model_memory
from raydl.parallel.mesh import layout_for
from raydl.parallel.wrapper_policy import choose_dp_wrapper

MIB = 2**20
# 4 equal blocks of 100 MiB of fp32 parameters, 10 MiB of activations and 1 MiB of output per sample.
BLOCKS = tuple(BlockMemory(f"b{i}", 100 * MIB, 10 * MIB, 1 * MIB, 40 * MIB) for i in range(4))
MODEL = ModelMemory(BLOCKS, loss_bytes=2 * MIB)
SGD = Setting(optimizer="sgd", momentum=0.0)


def test_one_worker_holds_weights_grads_states_and_one_micro_batch():
    p = predict(MODEL, dp=1, pp=1, micro_batch=4, setting=Setting(optimizer="adamw"))
    acts = 4 * 40 * MIB + 4 * 2 * MIB * 2   # 4 samples x 4 blocks, the loss kept and its gradient
    assert p.parts["weights"] == p.parts["grads"] == 400 * MIB and p.parts["optimizer"] == 800 * MIB
    # torch's AdamW on a CPU steps tensor by tensor: one temporary of the largest tensor (40 MiB) at a time
    assert p.parts["activations"] == acts and p.parts["step"] == 40 * MIB
    assert p.peak_bytes == 1600 * MIB + max(acts, 40 * MIB)
    assert "max(activations 176, step 40) = 1,776 MiB" in p.breakdown()
    fused = predict(MODEL, dp=1, pp=1, micro_batch=4, setting=Setting(optimizer="adamw", device_type="cuda"))
    assert fused.parts["step"] == 0 and fused.peak_bytes == 1600 * MIB + acts   # fused on a GPU: none


def test_fsdp_divides_the_static_state_over_dp_and_adds_the_unsharded_blocks():
    ddp = predict(MODEL, dp=2, pp=1, micro_batch=1, wrapper="ddp", setting=SGD)
    fsdp = predict(MODEL, dp=2, pp=1, micro_batch=1, wrapper="fsdp", setting=SGD)
    assert ddp.parts["weights"] == 400 * MIB and ddp.parts["ddp buckets"] == 400 * MIB and ddp.parts["optimizer"] == 0
    assert fsdp.parts["weights"] == fsdp.parts["grads"] == 200 * MIB and fsdp.parts["ddp buckets"] == 0
    assert fsdp.parts["unsharded"] == 3 * 100 * MIB   # the block computed, the next prefetched, its gradient
    assert fsdp.peak_bytes < ddp.peak_bytes
    # With a pipeline FSDP2 keeps the stage gathered from forward to backward.
    piped = predict(MODEL, dp=2, pp=2, micro_batch=1, num_microbatches=2, wrapper="fsdp", setting=SGD)
    assert piped.parts["weights"] == 100 * MIB and piped.parts["unsharded"] == 200 * MIB + 100 * MIB


def test_pipeline_ranks_hold_their_stage_and_the_schedules_micro_batches():
    one_f = predict(MODEL, dp=1, pp=2, micro_batch=1, num_microbatches=8, schedule="1f1b", setting=SGD)
    gpipe = predict(MODEL, dp=1, pp=2, micro_batch=1, num_microbatches=8, schedule="gpipe", setting=SGD)
    assert one_f.parts["weights"] == 200 * MIB
    # 1f1b: rank 0 keeps pp - 0 = 2 micro-batches in flight, GPipe all 8; the first stage has no loss.
    assert one_f.fullest == 0 and one_f.parts["activations"] == 2 * 20 * MIB
    assert gpipe.rank_peak_bytes[0] - 200 * MIB * 2 == 8 * 20 * MIB
    assert gpipe.rank_peak_bytes[1] > gpipe.rank_peak_bytes[0]   # the last stage also keeps the loss's


def test_activation_checkpointing_keeps_block_inputs_and_one_block():
    plain = predict(MODEL, dp=1, pp=1, micro_batch=2, setting=SGD)
    ac = predict(MODEL, dp=1, pp=1, micro_batch=2, setting=Setting(optimizer="sgd", momentum=0.0,
                                                                  activation_checkpointing=True))
    assert plain.parts["activations"] == 2 * (40 + 4) * MIB
    assert ac.parts["activations"] == 2 * (4 * 1 + 10 + 4) * MIB


@pytest.mark.parametrize("optimizer, momentum, states", [("adamw", 0.9, 2), ("sgd", 0.9, 1), ("sgd", 0.0, 0)])
def test_optimizer_states(optimizer, momentum, states):
    p = predict(MODEL, dp=1, pp=1, micro_batch=1, setting=Setting(optimizer=optimizer, momentum=momentum))
    assert p.parts["optimizer"] == states * 400 * MIB


def test_bf16_with_fsdp2_computes_on_bf16_copies_and_without_it_autocast_caches_them():
    fsdp = predict(MODEL, dp=2, pp=1, micro_batch=1, wrapper="fsdp", setting=Setting(precision="bf16"))
    ddp = predict(MODEL, dp=2, pp=1, micro_batch=1, wrapper="ddp", setting=Setting(precision="bf16"))
    assert fsdp.parts["unsharded"] == 150 * MIB and "casts" not in fsdp.parts
    assert fsdp.parts["weights"] == 200 * MIB and fsdp.parts["optimizer"] == 400 * MIB   # fp32 masters and states
    assert ddp.parts["casts"] == 200 * MIB


def test_cpu_offload_moves_the_sharded_state_off_a_gpu_only():
    gpu = predict(MODEL, dp=2, pp=1, micro_batch=1, wrapper="fsdp",
                  setting=Setting(cpu_offload=True, device_type="cuda"))
    cpu = predict(MODEL, dp=2, pp=1, micro_batch=1, wrapper="fsdp", setting=Setting(cpu_offload=True))
    assert gpu.parts["weights"] == gpu.parts["optimizer"] == 0 and gpu.offloaded_bytes == 800 * MIB
    assert cpu.parts["weights"] == 200 * MIB and cpu.offloaded_bytes == 0


def test_build_holds_the_own_share_plus_the_largest_tensor_or_everything_when_whole():
    assert build_bytes(MODEL, dp=2, pp=1, wrapper="fsdp") == 200 * MIB + 40 * MIB
    assert build_bytes(MODEL, dp=1, pp=2) == 200 * MIB
    assert build_bytes(MODEL, dp=2, pp=1, wrapper="fsdp", whole=True) == 400 * MIB


def test_the_wrapper_policy_shards_when_the_unsharded_prediction_does_not_fit():
    need = {"ddp": 900 * MIB, "replicate": 900 * MIB}
    assert choose_dp_wrapper("auto", dp=2, pp=1, param_bytes=1, memory_bytes=1000 * MIB, predicted=need.get)[0] == "ddp"
    wrapper, why = choose_dp_wrapper("auto", dp=2, pp=1, param_bytes=1, memory_bytes=800 * MIB, predicted=need.get)
    assert wrapper == "fsdp" and "900 MiB" in why and "exceeds 800 MiB" in why


def _cfg(*sets: str) -> JobConfig:
    return load_config(None, ["train.optimizer=sgd", "train.momentum=0", "train.global_batch_size=2",
                              "train.micro_batch_size=1", *sets])


def test_a_layout_that_cannot_fit_is_refused_with_the_numbers_and_what_fits():
    budget = 700 * MIB + RUNTIME_BYTES["cpu"]   # dp=2 fsdp needs 200 + 200 + 300 + activations
    with pytest.raises(LayoutError) as error:
        layout_for(_cfg("parallel.dp_wrapper=ddp"), 2, num_blocks=4, memory_bytes=budget,
                           model_memory=MODEL)
    text = str(error.value)
    assert "dp=2 (ddp)" in text and "ddp buckets 400" in text and "1.84 GiB" in text
    assert "--set parallel.pp_degree=2 --set parallel.dp_wrapper=fsdp" not in text   # 2 workers: pp=2 has dp=1
    assert "--set parallel.pp_degree=2" in text or "--set parallel.dp_wrapper=fsdp" in text
    # auto picks FSDP by the same prediction, and it fits.
    layout = layout_for(_cfg(), 2, num_blocks=4, memory_bytes=budget + 100 * MIB, model_memory=MODEL)
    assert layout.dp_wrapper == "fsdp" and "exceeds" in layout.dp_wrapper_reason


def test_nothing_fits_names_the_workers_that_would():
    with pytest.raises(LayoutError, match=r"none of the 2-worker layouts fits; 4 workers would fit"):
        layout_for(_cfg("train.global_batch_size=8"), 2, num_blocks=4,
                           memory_bytes=310 * MIB + RUNTIME_BYTES["cpu"], model_memory=MODEL)


def test_the_meta_probe_counts_parameters_and_per_sample_activations():
    with torch.device("meta"), SkipWeightInit():
        model = gpt_blocks(2, 64, 4, vocab_size=100, seq_len=16, dropout=0.0)
    counted = model_memory(model, gpt_spec, {"vocab_size": 100, "seq_len": 16})
    assert counted.activations_known and counted.param_bytes == 4 * sum(p.numel() for p in model.parameters())
    h0 = counted.blocks[1]
    assert h0.output_bytes == 16 * 64 * 4 and h0.activation_bytes > 10 * h0.output_bytes
    assert counted.largest_tensor_bytes == 64 * 256 * 4   # an MLP weight
    # the loss goes chunk by chunk: the head's hidden states, labels and log-sum-exps per sample, one chunk of logits
    assert counted.loss_bytes == 16 * 64 * 4 + 16 * (8 + 4) and counted.loss_chunk_bytes == chunk_bytes(100)
    assert counted.blocks[-1].output_bytes == 16 * 64 * 4   # the head hands back hidden states to the loss
    whole = model_memory(model, dataclasses.replace(gpt_spec, loss=lambda out, y: gpt_spec.loss(out, y)),
                         {"vocab_size": 100, "seq_len": 16})   # a loss of the user's: the logits, whole
    assert whole.loss_bytes == 16 * 100 * 4 and whole.loss_chunk_bytes == 0


def test_a_chunked_loss_predicts_less_than_whole_logits_at_gpt2_shape():
    """GPT-2 124M, 16 x 1024 tokens: whole fp32 logits and their gradient (2 x 3.1 GiB) against one chunk's."""
    meta = {"vocab_size": 50257, "seq_len": 1024}
    with torch.device("meta"), SkipWeightInit():
        model = build_gpt("gpt2", vocab_size=50257, seq_len=1024)
    chunked_model = model_memory(model, gpt_spec, meta)
    whole = model_memory(model, dataclasses.replace(gpt_spec, loss=lambda out, y: gpt_spec.loss(out, y)), meta)
    assert chunked_model.param_bytes == 4 * 124_475_904 == 4 * sum(p.numel() for p in model.parameters())
    saved = [memory.predict(whole, dp=1, pp=1, micro_batch=16).parts["activations"]
             - memory.predict(chunked_model, dp=1, pp=1, micro_batch=16).parts["activations"]]
    logits = 16 * 1024 * 50304 * 4
    assert 2 * logits - chunk_bytes(50304) - 16 * 1024 * 12 <= saved[0] <= 2 * logits, saved


def test_raydl_train_refuses_a_layout_that_cannot_fit_before_any_worker_starts(tmp_path, data_cache, capsys,
                                                                               monkeypatch):
    """docs/memory.md's first command (which marks it `tested by` this test) and the refusal that page prints."""
    from raydl.cli import main
    from tests.unit.test_bad_inputs_config import tree_digest

    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("untouched")
    before = tree_digest(tmp_path)
    sets = [f"data.cache_dir={data_cache}", "model.options.layers=24", "model.options.width=1024",
            "model.options.heads=16", "scaling.memory_per_worker_gb=2"]
    assert main(["train", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert "does not fit in memory" in err and "weights 577 + grads 577 + optimizer 1,153" in err
    assert "but has 2.00 GiB (scaling.memory_per_worker_gb=2)" in err and "workers would fit" in err
    assert "Traceback" not in err and tree_digest(tmp_path) == before
