"""`raydl generate`: a trained model's answers, in one process (no Ray, no process group).

    raydl generate runs/<run> --prompt "What is two plus three?"        # the run's newest checkpoint
    raydl generate my_llama --prompt "..." --temperature 0.7            # an export (save_pretrained dir)
    raydl generate runs/<run> --eval held_out.jsonl                     # exact match on held-out records

A run is rebuilt on the CPU from its config and checkpoint (raydl.export.trained) and encodes prompts with its
dataset's tokenizer; an export loads with transformers from safetensors (local files only) and its own
tokenizer files. A prompt is encoded as the training rows began: rendered with the chat template
(add_generation_prompt=True) when the data was chat records, else its tokens alone. Decoding is greedy, or samples
at --temperature; it stops at the end-of-turn token (the tokenizer's eos_token, which training learnt to put after
each answer), at --max-new-tokens, or at the model's last position.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from raydl.errors import ConfigError, DataError


@dataclass
class Answer:
    text: str
    tokens: int
    ended: bool     # stopped at the end-of-turn token (not at a length limit)


@dataclass
class Generator:
    logits: Callable[[torch.Tensor], torch.Tensor]    # (1, S) ids -> (1, S, vocab)
    tokenizer: Any          # a transformers PreTrainedTokenizerFast
    chat: bool              # prompts rendered with the chat template
    end: int                # the end-of-turn token id
    max_positions: int

    def encode(self, prompt: str | list[dict]) -> list[int]:
        """A user message (or a conversation so far) as the tokens a training row begins with."""
        if self.chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def answer(self, prompt: str | list[dict], *, max_new_tokens: int = 64, temperature: float = 0.0,
               seed: int = 0) -> Answer:
        ids = self.encode(prompt)
        if len(ids) >= self.max_positions:
            raise DataError(f"the prompt is {len(ids)} tokens, and the model takes at most {self.max_positions}. "
                            f"Fix: shorten the prompt.")
        generator = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while len(out) < max_new_tokens and len(ids) + len(out) <= self.max_positions:
            last = self.logits(torch.tensor([ids + out]))[0, -1].float()
            if temperature > 0:
                token = int(torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator))
            else:
                token = int(last.argmax())
            if token == self.end:
                return Answer(self.tokenizer.decode(out), len(out), True)
            out.append(token)
        return Answer(self.tokenizer.decode(out), len(out), False)


def load_generator(source: str, *, config: str | None = None, template: str = "auto",
                   tokenizer: str | None = None) -> Generator:
    """A run directory or checkpoint (rebuilt from its config) or a Hugging Face export directory. `tokenizer`: a
    tokenizer directory to encode with instead of the run's (the same vocabulary; e.g. a pre-trained run scored
    with the chat template its fine-tuning will use)."""
    from raydl.driver.init_from import is_hf_dir

    if is_hf_dir(source):
        return _from_export(Path(source), template, tokenizer)
    return _from_run(source, config, template, tokenizer)


def _from_run(source: str, config: str | None, template: str, tokenizer_dir: str | None) -> Generator:
    from raydl.export.trained import find_trained

    trained = find_trained(source, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the untie warning: the run printed it
        model = trained.load_into(trained.build())
    meta = trained.meta
    if tokenizer_dir:
        from raydl.data.hf_tokenizer import load_tokenizer_dir

        tokenizer = load_tokenizer_dir(tokenizer_dir)
        end = tokenizer.eos_token_id
        if len(tokenizer) != meta["vocab_size"]:
            raise ConfigError("--tokenizer", f"'{tokenizer_dir}' has {len(tokenizer)} tokens, the run's dataset "
                              f"{meta['vocab_size']}", "pass the tokenizer the run's data was prepared with")
    else:
        tokenizer, end = _dataset_tokenizer(trained.data), meta.get("eos")
    records = meta.get("records") or {}
    chat = _use_chat(template, records.get("format") == "chat", tokenizer, source)
    return Generator(lambda ids: model(ids), tokenizer, chat, end if end is not None else tokenizer.eos_token_id,
                     max_positions=meta["seq_len"])


def _dataset_tokenizer(data):
    """The dataset's tokenizer as a transformers tokenizer: its tokenizer directory (records), or its
    tokenizer.json (text) with <|endoftext|> as the end token."""
    from raydl.data.hf_tokenizer import load_tokenizer_dir
    from raydl.data.tokenizer import EOS_TOKEN, dataset_tokenizer

    meta = data.meta
    if meta.get("tokenizer_dir"):
        fs, _ = data.filesystem()
        return load_tokenizer_dir(data.inside(meta["tokenizer_dir"], "tokenizer_dir"), "the dataset's tokenizer")
    tok = dataset_tokenizer(data)
    if tok is None:
        raise DataError(f"dataset '{data.root}' has no tokenizer file (byte tokens or a built-in dataset), so raydl "
                        f"generate cannot encode text for it. Fix: prepare the data with --tokenizer (bpe, a "
                        f"tokenizer.json, or a tokenizer directory with --format).")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)


def _from_export(folder: Path, template: str, tokenizer_dir: str | None) -> Generator:
    from raydl.data.hf_tokenizer import load_tokenizer_dir
    from raydl.models.hf.classes import CLASSES, transformers_module
    from raydl.models.hf.config import read_config_dir

    config = read_config_dir("raydl generate", str(folder))
    transformers_module().utils.logging.disable_progress_bar()
    model_class = getattr(transformers_module(), CLASSES[config.model_type][1])
    model = model_class.from_pretrained(folder, config=config, local_files_only=True, use_safetensors=True).eval()
    tokenizer = load_tokenizer_dir(tokenizer_dir or folder, "--tokenizer" if tokenizer_dir else "raydl generate")
    chat = _use_chat(template, tokenizer.chat_template is not None, tokenizer, str(folder))
    return Generator(lambda ids: model(ids, use_cache=False).logits, tokenizer, chat, tokenizer.eos_token_id,
                     max_positions=config.max_position_embeddings)


def _use_chat(template: str, data_used_one: bool, tokenizer, source: str) -> bool:
    if template == "chat" and not tokenizer.chat_template:
        raise ConfigError("--template", f"is chat, but the tokenizer of '{source}' has no chat template",
                          "use --template none")
    return data_used_one if template == "auto" else template == "chat"


def exact_match(generator: Generator, path: str, *, max_new_tokens: int, limit: int = 0) -> dict[str, Any]:
    """Greedy answers to held-out records (prompt-response or chat, the last assistant turn being the expected
    answer) against their expected text, compared with surrounding whitespace stripped."""

    from raydl.data.prepare_records import jsonl_records

    matched = ended = total = too_long = 0
    examples = []
    for where, record, _ in jsonl_records(path):
        if limit and total >= limit:
            break
        prompt, expected = _prompt_and_answer(record, where)
        total += 1
        if len(generator.encode(prompt)) >= generator.max_positions:
            too_long += 1      # no room to answer: a miss
            continue
        answer = generator.answer(prompt, max_new_tokens=max_new_tokens)
        matched += answer.text.strip() == expected.strip()
        ended += answer.ended
        if len(examples) < 3:
            examples.append({"expected": expected, "answer": answer.text, "ended": answer.ended})
    if not total:
        raise DataError(f"'{path}' holds no records. Fix: pass a JSON-lines file of held-out records.")
    return {"records": total, "exact_match": matched / total, "ended_with_end_token": ended / total,
            "prompts_too_long": too_long, "examples": examples}


def _prompt_and_answer(record: Any, where: str) -> tuple[str | list[dict], str]:
    from raydl.data.prepare_records import messages_of, prompt_of, response_of

    if not isinstance(record, dict):
        raise DataError(f"{where} is not a JSON object. Fix: one record per line.")
    if "messages" in record or "conversations" in record:
        turns = messages_of(record, "", where)
        last = max((i for i, m in enumerate(turns) if m["role"] == "assistant"), default=None)
        if last is None:
            raise DataError(f"{where} has no assistant turn to compare with. Fix: end each record with the answer.")
        return turns[:last], turns[last]["content"]
    return prompt_of(record, "", where), response_of(record, "", where)[1]
