"""train.precision=fp8: which layers torchao's float8 takes, and the refusals where it cannot run (this machine has
no GPU: every fp8 run here is refused, by the real CLI, before Ray starts and with nothing written)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from raydl.cli import main
from raydl.errors import ConfigError
from raydl.models.gpt import gpt_blocks
from raydl.parallel.float8 import apply_float8, check_before_start, check_device

torchao = pytest.importorskip("torchao", reason="the fp8 extra: pip install -e '.[fp8]'")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def _gpt_on_meta(width: int, layers: int = 3):
    with torch.device("meta"):
        return gpt_blocks(layers, width, 16, vocab_size=50304, seq_len=1024, dropout=0.0)


def _float8_layers(model) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}


def test_tensorwise_takes_the_large_block_linears_and_leaves_the_head_and_small_ones():
    model = _gpt_on_meta(2048)
    assert apply_float8(model, scaling="tensorwise") == len(_float8_layers(model))
    layers = _float8_layers(model)
    assert layers and all(name.startswith("blocks.h") for name in layers)   # never embed or head
    assert not any(isinstance(m, Float8Linear) for m in model.blocks["head"].modules())
    # every block takes the same layers: one compilation still serves them all
    per_block = {b: sorted(n.split(".", 2)[2] for n in layers if n.startswith(f"blocks.{b}.")) for b in ("h0", "h1", "h2")}
    assert per_block["h0"] == per_block["h1"] == per_block["h2"]


def test_rowwise_filter_is_stricter_than_tensorwise_on_the_same_model():
    assert apply_float8(_gpt_on_meta(2048), scaling="rowwise") < apply_float8(_gpt_on_meta(2048), scaling="tensorwise")


def test_a_model_too_small_for_any_float8_layer_is_refused():
    model = gpt_blocks(2, 64, 4, vocab_size=96, seq_len=32, dropout=0.0)
    with pytest.raises(ConfigError, match="no Linear layer of this model can take it"):
        apply_float8(model, scaling="tensorwise")
    assert not _float8_layers(model)


def test_cpu_workers_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"'train.precision'.*8\.9.*Fix: use --set train.precision=bf16"):
        check_device(torch.device("cpu"))
    with pytest.raises(ConfigError, match="scaling.use_gpu=false"):
        check_before_start("fp8", workers_on_gpu=False, local=False)
    check_before_start("fp8", workers_on_gpu=None, local=False)   # a cluster's workers check their own GPU
    check_before_start("bf16", workers_on_gpu=False, local=True)


def _tree(root) -> str:
    return hashlib.sha256(b"".join(str(p).encode() + p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())).hexdigest()


@pytest.mark.parametrize("command", [["train", "--set", "train.precision=fp8"],
                                     ["sweep", "--config", "sweep.yaml"]])
def test_fp8_on_this_cpu_machine_exits_2_before_ray_starts(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweep.yaml").write_text("name: precisions\nobjective: eval_loss\nspace: {train.precision: [bf16, fp8]}\n")
    before = _tree(tmp_path)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "'train.precision'" in err and "8.9" in err and "Traceback" not in err
    assert _tree(tmp_path) == before
