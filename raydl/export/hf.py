"""--format hf: a `model.name: hf` checkpoint as `save_pretrained` output.

    DIR/config.json, generation_config.json, model.safetensors   (tie_word_embeddings=false: see raydl.models.hf)
    DIR/tokenizer.json, tokenizer_config.json                    when the dataset was tokenized with one

`AutoModelForCausalLM.from_pretrained(DIR)` (and `AutoTokenizer.from_pretrained(DIR)`) load it
with transformers alone. Before DIR appears, the written model is loaded back and its logits
compared with raydl's on a batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from raydl.errors import ConfigError
from raydl.export import require_close
from raydl.export.trained import Trained
from raydl.models.blocks import BlockModel


class HfExport:
    def __init__(self, trained: Trained):
        from raydl.models.hf.blocks import as_blocks
        from raydl.models.hf.model import build_causal_lm, spec

        if trained.choice.spec is not spec:
            raise ConfigError("--format", f"is hf, but checkpoint '{trained.checkpoint}' holds model "
                              f"'{trained.choice.spec.name}', not a Hugging Face one (model.name=hf)",
                              "use --format pt2, which exports any raydl model")
        torch.manual_seed(trained.cfg.train.seed)
        self.trained = trained
        self.model: nn.Module = build_causal_lm(trained.choice.options, trained.meta)
        # The blocks share the HF model's modules: loading them fills the model save_pretrained writes.
        self.blocks: BlockModel = trained.load_into(as_blocks(self.model))
        self.model.eval()

    def write(self, out: Path) -> None:
        from transformers.utils import logging

        logging.disable_progress_bar()
        self.model.save_pretrained(out)
        self._write_tokenizer(out)
        self._check(out)

    def _write_tokenizer(self, out: Path) -> None:
        from raydl.data.tokenizer import EOS_TOKEN

        name = self.trained.meta.get("tokenizer_file")
        if not name:
            return   # raydl's byte tokenizer and the built-in datasets have no tokenizer file
        data = self.trained.data
        fs, _ = data.filesystem()
        with fs.open_input_file(data.inside(name, "tokenizer_file")) as f:
            (out / "tokenizer.json").write_bytes(f.read())
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN}, indent=1))

    @torch.no_grad()
    def _check(self, out: Path) -> None:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, use_safetensors=True).eval()
        x = self.trained.choice.spec.example_inputs(self.trained.meta, 2)
        require_close(loaded(x, use_cache=False).logits, self.blocks(x), "Hugging Face model")
