"""A local Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json), through transformers.

Loaded as `PreTrainedTokenizerFast` from the directory alone: nothing is downloaded (HF_HUB_OFFLINE, local files
only) and no class the config names is imported (an `auto_map` or a custom `tokenizer_class` would be code), so
the directory is data. Its chat template is rendered by transformers in its sandboxed Jinja environment.
"""

from __future__ import annotations

import os
from pathlib import Path

from raydl.errors import DataError, one_line

REQUIRED = ("tokenizer.json", "tokenizer_config.json")
# What a dataset keeps of the directory, so that `raydl generate` encodes prompts as the rows were.
KEPT = REQUIRED + ("special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def load_tokenizer_dir(directory: str | Path, field: str = "--tokenizer"):
    folder = Path(directory).expanduser()
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        raise DataError(f"{field} '{directory}' is not a local tokenizer directory: it lacks "
                        f"{' and '.join(missing)}. Fix: pass the directory a model's tokenizer was saved in "
                        f"(`tokenizer.save_pretrained(DIR)`, or the model's own download directory); raydl never "
                        f"downloads one.")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise DataError(f"{field} '{directory}' needs the optional transformers package. Fix: "
                        f"pip install \"raydl[hf]\".") from None
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:     # transformers raises assorted errors for a malformed file
        raise DataError(f"{field} '{directory}' cannot be read as a tokenizer ({one_line(e)[:300]}). Fix: re-save "
                        f"it with `tokenizer.save_pretrained(DIR)`.") from None
    if tokenizer.eos_token_id is None:
        raise DataError(f"{field} '{directory}' has no eos_token in tokenizer_config.json, the token that ends a "
                        f"response or an assistant turn (the model learns to stop on it). Fix: set eos_token (e.g. "
                        f"\"<|im_end|>\" or \"<|eot_id|>\") in tokenizer_config.json.")
    return tokenizer
