"""JSON-lines records -> one token row each, with its loss mask, for fine-tuning.

    raydl data prepare --from jsonl data.jsonl --format chat --tokenizer MODEL_DIR --out data/chat
    raydl data prepare --from jsonl data.jsonl --format prompt-response --tokenizer MODEL_DIR --out data/pr

Formats (each record is a JSON object; field names configurable, the common ones recognised):
- text: `--column` (default text); every token a target.
- prompt-response: `--prompt-field` (prompt, or alpaca's instruction with its input after a blank line) and
  `--response-field` (response, completion, or alpaca's output). The prompt and the response are tokenized
  apart, so the prompt a user later sends encodes to the very tokens the row starts with.
- chat: `--messages-field` (messages: openai's role/content, or conversations: sharegpt's from/value), rendered
  with the tokenizer directory's own chat template (transformers' sandboxed Jinja). Each assistant turn must
  render after a prefix equal to what `add_generation_prompt=True` gives for the turns before it (checked on the
  text, and in tokens for the last turn), else the record is refused: generation would see another prompt.

Labels: the response (or the assistant turns, `--train-on last|assistant|all`) plus its end-of-turn token (the
tokenizer's eos_token, which must be in every trained turn); everything else -100. A row is (input_ids = tokens[:-1],
labels = tokens[1:] where a target, else -100), stored as variable-length lists: the loader pads each batch to the
dataset's seq_len, with a mask. Rows are right-padded, so under causal attention no real token sees padding, and
padding carries no label. With --pack several records share a row (raydl.data.packing), each keeping its own
(input, label) pairs and a document id. Records longer than --seq-len follow --overflow (truncate, drop, error),
counted in the summary.
Records are data: nothing in them runs; the template comes from the user's own tokenizer directory.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from raydl.data.dataset import IGNORE_LABEL
from raydl.data.input_files import Progress
from raydl.data.packing import packed_tables
from raydl.errors import DataError, one_line

FORMATS = ("text", "prompt-response", "chat")
TRAIN_ON = ("last", "assistant", "all")
OVERFLOW = ("truncate", "drop", "error")
BATCH_RECORDS = 1024
ROLES = {"user": "user", "human": "user", "system": "system", "assistant": "assistant", "gpt": "assistant",
         "model": "assistant", "bot": "assistant", "tool": "tool"}


@dataclass(frozen=True, kw_only=True)
class RecordFormat:
    format: str
    seq_len: int
    train_on: str = "assistant"
    overflow: str = "truncate"
    text_field: str = "text"
    prompt_field: str = ""       # "" = prompt, or alpaca's instruction (+ input)
    response_field: str = ""     # "" = response, completion, or alpaca's output
    messages_field: str = ""     # "" = messages or conversations
    pack: bool = False           # records packed into rows of seq_len (raydl.data.packing)

    def __post_init__(self) -> None:
        for flag, value, allowed in (("--format", self.format, FORMATS), ("--train-on", self.train_on, TRAIN_ON),
                                     ("--overflow", self.overflow, OVERFLOW)):
            if value not in allowed:
                raise DataError(f"{flag} {value!r} is not one of {', '.join(allowed)}. Fix: pick one of them.")


@dataclass
class Counts:
    records: int = 0
    truncated: int = 0
    dropped: int = 0           # longer than --seq-len under --overflow drop, or truncated to no target
    target_tokens: int = 0
    rows: int = 0
    row_tokens: int = 0        # real (not padding) tokens over every row

    def summary(self, seq_len: int) -> dict[str, int | float]:
        """The counts, and `fill`: the share of the rows' seq_len slots that hold a real token."""
        return {**vars(self), "fill": round(self.row_tokens / max(self.rows * seq_len, 1), 4)}


@dataclass
class Tokenized:
    ids: list[int] = field(default_factory=list)
    targets: list[bool] = field(default_factory=list)

    def add(self, ids: list[int], target: bool) -> None:
        self.ids += ids
        self.targets += [target] * len(ids)


class RecordEncoder:
    """A record -> its tokens and which of them are targets, for one format and tokenizer."""

    def __init__(self, tokenizer, fmt: RecordFormat, where: str):
        self.tok, self.fmt, self.eot = tokenizer, fmt, tokenizer.eos_token_id
        if fmt.format == "chat":
            try:
                import jinja2  # noqa: F401  transformers renders chat templates with it, an optional dependency of its own
            except ImportError:
                raise DataError("--format chat renders the tokenizer's chat template with jinja2, which is not "
                                "installed. Fix: pip install \"raydl[hf]\".") from None
        if fmt.format == "chat" and not tokenizer.chat_template:
            raise DataError(f"--format chat needs a chat template, and tokenizer '{where}' has none (no "
                            f"chat_template in its tokenizer_config.json or chat_template.jinja). Fix: use the "
                            f"tokenizer directory of an instruct/chat model, add its template, or use --format "
                            f"prompt-response.")

    def encode(self, record: Any, where: str) -> Tokenized:
        if not isinstance(record, dict):
            raise DataError(f"{where} is a JSON {type(record).__name__}, not an object. Fix: one JSON object per line.")
        if self.fmt.format == "text":
            return self._plain([], _text(record, self.fmt.text_field, where), where, self.fmt.text_field)
        if self.fmt.format == "prompt-response":
            prompt = prompt_of(record, self.fmt.prompt_field, where)
            name, response = response_of(record, self.fmt.response_field, where)
            return self._plain(self._ids(prompt), response, where, name)
        return self._chat(messages_of(record, self.fmt.messages_field, where), where)

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def _plain(self, prompt: list[int], target: str, where: str, name: str) -> Tokenized:
        if not target:
            raise DataError(f"{where} field '{name}' is empty: the record has no target token to learn. Fix: remove "
                            f"the record or fill the field.")
        out = Tokenized()
        out.add(prompt, False)
        out.add(self._ids(target) + [self.eot], True)
        return out

    def render(self, messages: list[dict], where: str, *, generation: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        except Exception as e:    # the template's own raise_exception (roles must alternate...), or a Jinja error
            raise DataError(f"{where}: the tokenizer's chat template refuses these messages ({one_line(e)[:200]}). "
                            f"Fix: correct the record (e.g. alternate user and assistant turns).") from None

    def _chat(self, messages: list[dict], where: str) -> Tokenized:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise DataError(f"{where} field '{self.fmt.messages_field or 'messages'}' has no assistant turn: the "
                            f"record has no target token to learn. Fix: remove the record or add the answer.")
        full = self.render(messages, where, generation=False)
        spans = []
        for i in turns:
            prompt = self.render(messages[:i], where, generation=True) if i else ""
            through = self.render(messages[:i + 1], where, generation=False)
            if not (through.startswith(prompt) and full.startswith(through)):
                raise DataError(f"{where}: the chat template renders assistant turn {i} after text that is not what "
                                f"add_generation_prompt=True gives for the turns before it, so the prompt a user sends "
                                f"would differ from the training rendering. Fix: use a template whose rendering of "
                                f"earlier turns does not change when a turn is added.")
            spans.append((len(prompt), len(through)))
        trained = set(range(len(spans))) if self.fmt.train_on != "last" else {len(spans) - 1}
        out, start = Tokenized(), 0
        for k, (begin, end) in enumerate(spans):
            out.add(self._ids(full[start:begin]), self.fmt.train_on == "all")
            answer = self._ids(full[begin:end])
            if k in trained and self.eot not in answer:
                raise DataError(f"{where}: the chat template does not end assistant turn {turns[k]} with the "
                                f"tokenizer's eos_token {self.tok.eos_token!r}, so a model trained on it would never "
                                f"learn to stop. Fix: set eos_token in tokenizer_config.json to the template's "
                                f"end-of-turn token.")
            if k == len(spans) - 1 and self._ids(full[:begin]) != out.ids:
                raise DataError(f"{where}: the generation prompt of the last assistant turn tokenizes differently "
                                f"alone than inside the whole conversation, so generation would see other tokens. "
                                f"Fix: use a template that ends the generation prompt at a token boundary (e.g. with "
                                f"a special token or a newline).")
            out.add(answer, k in trained or self.fmt.train_on == "all")
            start = end
        out.add(self._ids(full[start:]), self.fmt.train_on == "all")
        return out


def _field(record: dict, names: tuple[str, ...], where: str, what: str, flag: str) -> tuple[str, Any]:
    for name in names:
        if name in record:
            return name, record[name]
    raise DataError(f"{where} has no {what} field {' or '.join(map(repr, names))} (it has: "
                    f"{', '.join(map(str, record)) or 'nothing'}). Fix: pass {flag} NAME with the field that holds it.")


def _string(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where} field '{name}' is a JSON {type(value).__name__}, not a string. Fix: repair the "
                        f"record.")
    return value


def _text(record: dict, name: str, where: str) -> str:
    return _string(_field(record, (name,), where, "text", "--column")[1], name, where)


def prompt_of(record: dict, name: str, where: str) -> str:
    if name:
        return _string(_field(record, (name,), where, "prompt", "--prompt-field")[1], name, where)
    if "prompt" in record:
        return _string(record["prompt"], "prompt", where)
    found, value = _field(record, ("instruction",), where, "prompt", "--prompt-field")
    text = _string(value, found, where)
    extra = _string(record.get("input") or "", "input", where)
    return f"{text}\n\n{extra}" if extra else text


def response_of(record: dict, name: str, where: str) -> tuple[str, str]:
    found, value = _field(record, (name,) if name else ("response", "completion", "output"), where, "response",
                          "--response-field")
    return found, _string(value, found, where)


def messages_of(record: dict, name: str, where: str) -> list[dict]:
    found, value = _field(record, (name,) if name else ("messages", "conversations"), where, "messages",
                          "--messages-field")
    if not isinstance(value, list) or not value:
        raise DataError(f"{where} field '{found}' is not a non-empty list of messages. Fix: repair the record.")
    return [_message(m, f"{where} field '{found}'[{i}]") for i, m in enumerate(value)]


def _message(message: Any, where: str) -> dict:
    """openai {role, content} (content a string or a list of text parts) or sharegpt {from, value}."""
    if not isinstance(message, dict):
        raise DataError(f"{where} is not a message object. Fix: use {{\"role\", \"content\"}} or "
                        f"{{\"from\", \"value\"}}.")
    role = message.get("role", message.get("from"))
    content = message.get("content", message.get("value"))
    if isinstance(content, list):     # openai's content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if role not in ROLES or not isinstance(content, str):
        raise DataError(f"{where} has role {role!r} and content of type {type(content).__name__}: raydl reads "
                        f"roles {', '.join(ROLES)} with string content. Fix: repair the message.")
    return {"role": ROLES[role], "content": content}


def row(tokens: Tokenized, fmt: RecordFormat, counts: Counts, where: str) -> tuple[list[int], list[int]] | None:
    """(input_ids, labels) of one record, its overflow handled (None: dropped)."""
    ids, targets = tokens.ids, tokens.targets
    if len(ids) - 1 > fmt.seq_len:
        if fmt.overflow == "error":
            raise DataError(f"{where} is {len(ids)} tokens, longer than --seq-len {fmt.seq_len} + 1. Fix: raise "
                            f"--seq-len, or pass --overflow truncate or --overflow drop.")
        if fmt.overflow == "drop":
            counts.dropped += 1
            return None
        ids, targets = ids[:fmt.seq_len + 1], targets[:fmt.seq_len + 1]
        counts.truncated += 1
    labels = [t if target else IGNORE_LABEL for t, target in zip(ids[1:], targets[1:])]
    learnt = sum(label != IGNORE_LABEL for label in labels)
    if not learnt:      # truncation cut every target off
        counts.dropped += 1
        return None
    counts.target_tokens += learnt
    return ids[:-1], labels


def jsonl_records(path: Path | str) -> Iterator[tuple[str, Any, int]]:
    """(where, record, bytes read) for each non-blank line of a JSON-lines file; `where` names the file and line for
    an error paragraph. A line that is not JSON is refused here."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"'{path}' line {lineno}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where} is not valid JSON ({e}). Fix: repair or remove that line.") from None
            yield where, record, len(line)


def record_rows(files: list[Path], encoder: RecordEncoder, fmt: RecordFormat, counts: Counts,
                progress: Progress) -> Iterator[pa.Table]:
    """One row per record of the jsonl files, BATCH_RECORDS records a table; with `fmt.pack`, the records packed
    into rows of seq_len (raydl.data.packing)."""
    records = _records(files, encoder, fmt, counts, progress)
    tables = packed_tables(records, fmt.seq_len) if fmt.pack else _one_per_row(records)
    for table in tables:
        counts.rows += table.num_rows
        counts.row_tokens += pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0
        yield table


def _records(files: list[Path], encoder: RecordEncoder, fmt: RecordFormat, counts: Counts,
             progress: Progress) -> Iterator[tuple[list[int], list[int]]]:
    """(input_ids, labels) of every record kept (raydl.data.prepare_records.row)."""
    for path in files:
        for where, record, nbytes in jsonl_records(path):
            progress.update(nbytes=nbytes)
            counts.records += 1
            one = row(encoder.encode(record, where), fmt, counts, where)
            if one is not None:
                yield one
        progress.update(files=1)


def _one_per_row(records: Iterator[tuple[list[int], list[int]]]) -> Iterator[pa.Table]:
    kind = pa.list_(pa.int32())
    while batch := list(itertools.islice(records, BATCH_RECORDS)):
        yield pa.table({"input_ids": pa.array([ids for ids, _ in batch], kind),
                        "labels": pa.array([labels for _, labels in batch], kind)})
