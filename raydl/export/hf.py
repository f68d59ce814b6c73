"""--format hf: a `model.name: hf` checkpoint as `save_pretrained` output.

    DIR/config.json, generation_config.json                      (tie_word_embeddings=false: see raydl.models.hf)
    DIR/model.safetensors, or model-0000K-of-0000N.safetensors + model.safetensors.index.json
    DIR/tokenizer.json, tokenizer_config.json                    when the dataset was tokenized with one (records:
                                                                 the tokenizer directory, chat template included)

A LoRA run (train.lora) exports its base weights with the adapters merged into them (peft's merge), the model
built whole in memory. `AutoModelForCausalLM.from_pretrained(DIR)` (and `AutoTokenizer.from_pretrained(DIR)`) load it
with transformers alone. The tensors stream from the checkpoint shard by shard (raydl.export.hf_shards):
no process holds the whole model. Before DIR appears, a small model (up to CHECK_BYTES) is loaded back
and its logits compared with raydl's on a batch; a larger one has every tensor's name and shape checked
from the written headers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from raydl import storage
from raydl.errors import ConfigError
from raydl.export import require_close
from raydl.export.hf_shards import save_safetensors, write_shards
from raydl.export.trained import Trained
from raydl.models.blocks import BlockModel
from raydl.models.build import SkipWeightInit
from raydl.models.hf.weights import check_weights, expected_tensors
from raydl.models.lora import merge_adapters


CHECK_BYTES = 2**30   # up to this model size the written directory is loaded back and its logits compared


class HfExport:
    def __init__(self, trained: Trained):
        from raydl.models.hf.model import HfBlocks, spec

        if trained.choice.spec is not spec:
            raise ConfigError("--format", f"is hf, but checkpoint '{trained.checkpoint}' holds model "
                              f"'{trained.choice.spec.name}', not a Hugging Face one (model.name=hf)",
                              "use --format pt2, which exports any raydl model")
        self.trained = trained
        with torch.device("meta"), SkipWeightInit(), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the untie warning: the run printed it
            self.shapes = HfBlocks.build(trained.choice.options, trained.meta)   # names and shapes, no storage
        self.names = hf_names(self.shapes)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.shapes.parameters())

    def write(self, out: Path) -> None:
        from transformers import GenerationConfig

        config = self.shapes.causal_lm.config   # tie_word_embeddings=false: see raydl.models.hf
        config.dtype = torch.float32
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        if self.trained.adapters:   # a LoRA run: its base weights with the adapters folded in (peft's merge)
            merged = merge_adapters(self.trained.load_into(self.trained.build())).state_dict()
            save_safetensors(out / "model.safetensors", {hf: merged[ours].contiguous().clone()
                                                         for ours, hf in self.names.items()})
        else:
            with storage.local_copy(str(self.trained.checkpoint), "export source") as checkpoint:
                write_shards(checkpoint, self.names, out)
        write_tokenizer(self.trained, out)
        self._check(out)

    def _check(self, out: Path) -> None:
        """Small models: loaded back with transformers, logits against raydl's model loaded from the checkpoint.
        Large ones (no process should hold them whole): every tensor is there with its shape, from the headers."""
        if self.nbytes > CHECK_BYTES:
            check_weights(str(out), expected_tensors(self.shapes.causal_lm), {})
            return
        self._check_logits(out)

    @torch.no_grad()
    def _check_logits(self, out: Path) -> None:
        from transformers import AutoModelForCausalLM

        blocks = self.trained.load_into(self.trained.build())
        loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, use_safetensors=True).eval()
        x = self.trained.choice.spec.example_inputs(self.trained.meta, 2)
        require_close(loaded(x, use_cache=False).logits, blocks(x), "Hugging Face model")


def hf_names(blocks: BlockModel) -> dict[str, str]:
    """raydl name -> Hugging Face name of every tensor a checkpoint holds, in the transformers model's order
    (the blocks hold the very tensors of `blocks.causal_lm`)."""
    ours = {id(t): name for name, t in blocks.state_dict(keep_vars=True).items()}
    return {ours[id(t)]: name for name, t in blocks.causal_lm.state_dict(keep_vars=True).items()}


def write_tokenizer(trained: Trained, out: Path) -> None:
    """The tokenizer the run's dataset was made with, beside an exported model or adapter."""
    from raydl.data.hf_tokenizer import KEPT
    from raydl.data.tokenizer import EOS_TOKEN

    data = trained.data
    fs, _ = data.filesystem()
    folder = trained.meta.get("tokenizer_dir")
    if folder:   # records (raydl data prepare --format): the tokenizer directory they were made with, template included
        root = data.inside(folder, "tokenizer_dir")
        for name in KEPT:
            if fs.get_file_info(f"{root}/{name}").is_file:
                (out / name).write_bytes(storage.read_bytes(fs, f"{root}/{name}"))
        return
    name = trained.meta.get("tokenizer_file")
    if not name:
        return   # raydl's byte tokenizer and the built-in datasets have no tokenizer file
    with fs.open_input_file(data.inside(name, "tokenizer_file")) as f:
        (out / "tokenizer.json").write_bytes(f.read())
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN}, indent=1))
