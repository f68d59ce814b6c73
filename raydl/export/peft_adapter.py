"""--format peft (raydl export --adapter DIR): a LoRA run's adapters as a peft adapter directory.

    DIR/adapter_config.json          peft's LoraConfig: rank, alpha, dropout, the Hugging Face names of the wrapped
                                     modules, base_model_name_or_path = the run's base (model.options.weights)
    DIR/adapter_model.safetensors    base_model.model.<HF module>.lora_A/lora_B.weight, as peft saves them
    DIR/tokenizer.json, ...          the dataset's tokenizer, as --format hf writes it

`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)` loads it. Before DIR appears
that is done, and its logits compared with raydl's model's (within raydl.export.TOLERANCE). The base must be a
Hugging Face directory (the run's train.init_from or model.options.weights): peft adds adapters to a transformers
model; the merged model (--format hf) needs none.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from raydl.config_lora import lora_settings
from raydl.errors import ConfigError
from raydl.export import require_close
from raydl.export.hf import write_tokenizer
from raydl.export.hf_shards import save_safetensors
from raydl.export.trained import Trained
from raydl.models.lora import ADAPTER, is_adapter, peft_config

WEIGHTS_FILE = "adapter_model.safetensors"


class PeftExport:
    def __init__(self, trained: Trained):
        from raydl.models.hf.model import spec

        if trained.adapters is None:
            raise ConfigError("--format", f"is peft, but checkpoint '{trained.checkpoint}' is of a run without "
                              "adapters (train.lora is empty)", "use --format hf to export the whole model")
        if trained.choice.spec is not spec:
            raise ConfigError("--format", f"is peft, but checkpoint '{trained.checkpoint}' holds model "
                              f"'{trained.choice.spec.name}', not a Hugging Face one (model.name=hf), which peft "
                              "adapts", "use --format pt2, which exports any raydl model with its adapters")
        self.base = trained.choice.options.weights
        if not self.base:
            raise ConfigError("--format", f"is peft, but the adapters of checkpoint '{trained.checkpoint}' were "
                              f"trained on {trained.adapters.fingerprint['lora_base']}, not on a Hugging Face "
                              "directory that peft could load them onto", "export the merged model with --format hf "
                              "(or start the run from a save_pretrained directory: train.init_from)")
        self.trained = trained
        self.model = trained.load_into(trained.build())

    def write(self, out: Path) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        causal_lm = self.model.causal_lm
        save_safetensors(out / WEIGHTS_FILE, {f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}":
                                              t.detach().contiguous()
                                              for name, t in causal_lm.named_parameters() if is_adapter(name)})
        targets = sorted(name for name, m in causal_lm.named_modules() if isinstance(m, BaseTunerLayer))
        config = peft_config(lora_settings(self.trained.cfg.train.lora), targets)
        config.base_model_name_or_path, config.task_type = str(self.base), "CAUSAL_LM"
        config.save_pretrained(str(out))
        write_tokenizer(self.trained, out)
        self._check(out)

    @torch.no_grad()
    def _check(self, out: Path) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.base, local_files_only=True, use_safetensors=True)
        with warnings.catch_warnings():   # transformers' deprecation notes to peft, not to the user
            warnings.simplefilter("ignore", FutureWarning)
            loaded = PeftModel.from_pretrained(base, str(out), local_files_only=True).eval()
        x = self.trained.choice.spec.example_inputs(self.trained.meta, 2)
        require_close(loaded(input_ids=x, use_cache=False).logits, self.model(x), "peft adapter")
