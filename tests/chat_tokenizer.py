"""A small local Hugging Face tokenizer directory with a chat template, made here (nothing downloaded).

    make_tokenizer_dir(path)                   tokenizer.json + tokenizer_config.json (ChatML template)
    make_tokenizer_dir(path, template=None)    the same without a chat template
    make_tokenizer_dir(path, split_digits=True)  one token per digit, as Llama 2's and Qwen2's tokenizers split them
    python -m tests.chat_tokenizer DIR [--split-digits]    from the shell (docs/finetune.md)

A byte-level BPE trained on a little text by `tokenizers`, with the special tokens a chat model has:
<|endoftext|> (pad, and the document separator of `raydl data prepare --from text`), <|im_start|> and
<|im_end|> (the end-of-turn token, which is also eos, as in Qwen2's instruct tokenizers). Used by the tests
and by docs/finetune.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog. What is two plus three? Two plus three is five. "
               "system user assistant You are a helpful assistant. Hello! How are you? I am fine, thank you. "
               "one two three four five six seven eight nine ten eleven twelve thirteen plus minus is equals ")


def make_tokenizer_dir(path: str | Path, *, texts: Iterable[str] = (SAMPLE_TEXT,), vocab_size: int = 400,
                       template: str | None = CHATML, split_digits: bool = False) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # Numbers as digits make a number's value learnable from other numbers (examples/number_words.py); merged,
    # "347" would be a token the training records may never show.
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if split_digits else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "unk_token": None, "model_max_length": 4096, "clean_up_tokenization_spaces": False}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return path


if __name__ == "__main__":
    import sys

    print(make_tokenizer_dir(sys.argv[1], split_digits="--split-digits" in sys.argv[2:]))
