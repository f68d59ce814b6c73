"""Text -> token ids for `raydl data prepare`: byte-level, or BPE through Hugging Face `tokenizers`.

    --tokenizer bytes          every UTF-8 byte is a token (vocab 257: 256 bytes + EOS); nothing to train
    --tokenizer bpe            train a byte-level BPE of --vocab-size on the input itself (one extra pass)
    --tokenizer FILE.json      an existing `tokenizers` file (e.g. GPT-2's tokenizer.json)

A BPE tokenizer is saved as `tokenizer.json` in the dataset, so `raydl data inspect` can
decode rows and the same file can encode prompts later. Its end-of-document token is
`<|endoftext|>`, which a given file must have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow.fs as pafs

from raydl import storage
from raydl.errors import DataError, one_line

EOS_TOKEN = "<|endoftext|>"
BYTE_EOS = 256


class ByteTokenizer:
    name, vocab_size, eos = "bytes", BYTE_EOS + 1, BYTE_EOS

    def encode(self, texts: list[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(t, np.uint8).astype(np.int32) for t in texts]

    def save(self, fs: pafs.FileSystem, root: str) -> dict:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eos": self.eos}


class BpeTokenizer:
    name = "bpe"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos = tokenizer.token_to_id(EOS_TOKEN)

    def encode(self, texts: list[bytes]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch([t.decode("utf-8", errors="replace") for t in texts])
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def save(self, fs: pafs.FileSystem, root: str) -> dict:
        # an OSError if the disk or the upload fails
        storage.write_bytes(fs, f"{root}/tokenizer.json", self.tokenizer.to_str(pretty=True).encode())
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eos": self.eos,
                "tokenizer_file": "tokenizer.json"}


def load(spec: str, *, vocab_size: int, training_texts: Iterable[bytes]) -> ByteTokenizer | BpeTokenizer:
    """`spec` is bytes, bpe (trained on `training_texts`) or a tokenizer.json path."""
    if spec == "bytes":
        return ByteTokenizer()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if spec == "bpe":
        if vocab_size <= BYTE_EOS + 1:
            raise DataError(f"--vocab-size {vocab_size} is too small for a byte-level BPE (it starts from 256 "
                            f"bytes and {EOS_TOKEN}). Fix: use e.g. --vocab-size 8192.")
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator((t.decode("utf-8", errors="replace") for t in training_texts), trainer=trainer)
        return BpeTokenizer(tokenizer)
    path = Path(spec)
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:      # tokenizers raises a plain Exception for a missing or malformed file
        raise DataError(f"--tokenizer '{spec}' is not bytes, bpe, or a readable tokenizers JSON file ({one_line(e)}). "
                        f"Fix: pass bytes, bpe, or the path of a tokenizer.json.") from None
    if tokenizer.token_to_id(EOS_TOKEN) is None:
        raise DataError(f"tokenizer '{spec}' has no {EOS_TOKEN} token, which raydl puts between documents. "
                        f"Fix: add it as a special token, or use --tokenizer bpe to train one.")
    return BpeTokenizer(tokenizer)


def dataset_tokenizer(info):
    """The `tokenizers.Tokenizer` a dataset keeps (tokenizer.json, or tokenizer/tokenizer.json of a records
    dataset), or None (byte tokens, or no tokenizer)."""
    meta = info.meta
    name = meta.get("tokenizer_file") or (f"{meta['tokenizer_dir']}/tokenizer.json" if meta.get("tokenizer_dir") else None)
    if not name:
        return None
    from tokenizers import Tokenizer

    fs, _ = info.filesystem()
    path = info.inside(name, "tokenizer_file" if meta.get("tokenizer_file") else "tokenizer_dir")
    try:
        with fs.open_input_file(path) as f:
            return Tokenizer.from_str(f.read().decode("utf-8"))
    except Exception as e:      # tokenizers raises a plain Exception for a malformed file
        raise DataError(f"the dataset's tokenizer '{path}' cannot be read ({one_line(e)}). Fix: re-create the dataset "
                        f"with `raydl data prepare`.") from None


def token_names(info):
    """id -> the text of that one token (for `raydl data inspect --tokens`)."""
    if info.meta.get("tokenizer") == "bytes":
        return lambda t: "<eos>" if t == BYTE_EOS else repr(bytes([t]))[2:-1]
    tokenizer = dataset_tokenizer(info)
    if tokenizer is None:
        return str
    return lambda t: repr(tokenizer.decode([int(t)], skip_special_tokens=False))[1:-1]


def decoder(info):
    """ids -> text for a dataset's tokenizer (for `raydl data inspect`), or None."""
    meta = info.meta
    if meta.get("tokenizer") == "bytes":
        return lambda ids: bytes(t for t in ids if t < BYTE_EOS).decode("utf-8", errors="replace")
    tokenizer = dataset_tokenizer(info)
    if tokenizer is None:
        return None
    return lambda ids: tokenizer.decode([int(t) for t in ids if t != meta["eos"]])
