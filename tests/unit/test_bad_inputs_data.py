"""Bad input to `raydl data prepare`, `raydl data inspect` and a hostile dataset given to `raydl train`,
through the CLI as a user types it.

Every case must end in one paragraph that names the input and the fix, exit code 2, no traceback,
and nothing changed under the test's directory: no half-written dataset, no file touched (the
tree is hashed before and after). Full and read-only disks are simulated by an OSError injected
where raydl writes (the tests run as root, for whom a read-only directory is writable).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from raydl.cli import main
from raydl.data.prepare import prepare
from tests.unit.test_data_prepare import write_images, write_texts


def fixed(values: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), values.shape[1])


def prepare_cli(kind: str, src, *extra: str):
    """argv(tmp) of `raydl data prepare`; `src(tmp)` makes the input and returns its path or pattern."""
    return lambda tmp: ["data", "prepare", "--from", kind, str(src(tmp)), "--out", str(tmp / "out"), "--quiet", *extra]


def text_file(data: bytes, name: str = "t.txt"):
    def make(tmp: Path) -> Path:
        (tmp / name).write_bytes(data)
        return tmp / name
    return make


def parquet_file(table: pa.Table):
    def make(tmp: Path) -> Path:
        pq.write_table(table, tmp / "in.parquet")
        return tmp / "in.parquet"
    return make


def loop(pattern: str = ""):
    """A directory with a text file and a link back up to itself; `pattern` globs through it."""
    def make(tmp: Path) -> str:
        write_texts(tmp / "corpus" / "a", files=1, words=50)
        (tmp / "corpus" / "a" / "up").symlink_to(tmp / "corpus")
        return f"{tmp / 'corpus'}{pattern}"
    return make


def bracket_glob(tmp: Path) -> str:
    """Files in a directory named v[2], globbed without escaping the '['."""
    write_texts(tmp / "v[2]", files=1)
    return f"{tmp}/v[2]/*.txt"


def png(width: int, height: int) -> bytes:
    """A PNG that claims width x height 1-bit pixels over a few bytes of zlib data. Pillow checks the
    size when it opens a file, before decoding, which is what a decompression bomb must be stopped by."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    pixels = zlib.compress(bytes(64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def bomb(width: int):
    """An image folder with one image of width^2 pixels."""
    def make(tmp: Path) -> Path:
        root = write_images(tmp / "imgs", per_class=2)
        (root / "red" / "bomb.png").write_bytes(png(width, width))
        return root
    return make


def corrupt_parquet(tmp: Path) -> Path:
    """A footer that still parses over data pages that do not."""
    x = np.arange(4096 * 8).reshape(-1, 8)
    pq.write_table(pa.table({"input_ids": fixed(x), "labels": fixed(x)}), tmp / "in.parquet")
    data = bytearray((tmp / "in.parquet").read_bytes())
    data[4:len(data) // 2] = b"\xff" * (len(data) // 2 - 4)
    (tmp / "in.parquet").write_bytes(data)
    return tmp / "in.parquet"


def dataset(change=None):
    """argv(tmp) of `raydl data inspect` on a prepared dataset, after `change(dataset dir, tmp)`."""
    def argv(tmp: Path) -> list[str]:
        prepare("text", str(write_texts(tmp / "txt", files=1, words=3000)), str(tmp / "ds"), seq_len=32,
                shard_rows=256, progress=False)
        change(tmp / "ds", tmp)
        return ["data", "inspect", str(tmp / "ds")]
    return argv


def manifest(first_shard_file: str | None = None, **top):
    """Set the first train shard's file name and top-level keys in manifest.json."""
    def change(ds: Path, tmp: Path) -> None:
        data = json.loads((ds / "manifest.json").read_text())
        if first_shard_file is not None:
            data["splits"]["train"]["shards"][0]["file"] = first_shard_file
        (ds / "manifest.json").write_text(json.dumps({**data, **top}))
    return change


def first_shard(write):
    return lambda ds, tmp: write(ds / "train-00000.parquet", tmp)


def truncate(shard: Path, tmp: Path) -> None:
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])


def empty(shard: Path, tmp: Path) -> None:
    pq.write_table(pq.read_table(shard).slice(0, 0), shard)


def link_out(shard: Path, tmp: Path) -> None:
    shutil.copy(shard, tmp / "elsewhere.parquet")
    shard.unlink()
    shard.symlink_to(tmp / "elsewhere.parquet")


def train_on(change):
    """argv(tmp) of `raydl train` on a dataset changed by `change`: refused before any worker starts."""
    def argv(tmp: Path) -> list[str]:
        dataset(change)(tmp)
        return ["train", "--set", f"data.path={tmp / 'ds'}", "--set", f"run.runs_dir={tmp / 'runs'}"]
    return argv


def fail_with(target: str, code: int):
    """Make `module.function` raise OSError(code) while the CLI runs."""
    def inject(monkeypatch) -> None:
        def refuse(*args, **kwargs):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(target, refuse)
    return inject


ESCAPE = "splits.train.shards[0].file"
TEXT = b"plain words\n" * 200
CASES = [
    # prepare: text that is not text
    ("text-lone-surrogate", prepare_cli("text", text_file(TEXT + b"half \xed\xa0\x80 a pair\n")), None,
     ["t.txt' is not UTF-8 text: byte 2405", "iconv"]),
    ("jsonl-lone-surrogate", prepare_cli("jsonl", text_file(b'{"text": "ok"}\n{"text": "a\\ud800b"}\n', "t.jsonl")),
     None, ["t.jsonl' line 2", "lone surrogate"]),
    ("parquet-text-not-utf8", prepare_cli("parquet", parquet_file(pa.table(
        {"text": pa.array([b"fine", b"\xed\xa0\x80"], pa.binary()).view(pa.string())}))), None,
     ["in.parquet' column text holds text that is not UTF-8"]),
    # prepare: which files
    ("directory-symlink-loop", prepare_cli("text", loop()), None, ["corpus/a/up' links back to", "symlink loop"]),
    ("glob-through-symlink-loop", prepare_cli("text", loop("/**/*.txt")), None,
     ["corpus/**/*.txt' reaches the same file", "corpus/a/doc0.txt"]),
    ("image-glob-matches-nothing", prepare_cli("images", lambda tmp: tmp / "imgs" / "*" / "*.png"), None,
     ["imgs/*/*.png' matches no files"]),
    ("bracket-is-a-glob-class", prepare_cli("text", bracket_glob), None,
     ["v[2]/*.txt' matches no files", "write '[[]' for a literal '['"]),
    # prepare: images
    ("decompression-bomb-error", prepare_cli("images", bomb(14_000)), None,          # > 2x Pillow's limit
     ["red/bomb.png' is too large to decode safely", "pixels"]),
    ("decompression-bomb-warning", prepare_cli("images", bomb(10_000)), None,        # > 1x: Pillow only warns
     ["red/bomb.png' is too large to decode safely"]),
    ("images-of-different-sizes", prepare_cli("parquet", parquet_file(pa.table({
        "image": pa.array([[0] * 12, [0] * 27], pa.list_(pa.uint8())), "label": pa.array([0, 1])}))), None,
     ["in.parquet' column image is list<element: uint8>", "fixed-size list"]),
    # prepare: parquet
    ("corrupt-parquet", prepare_cli("parquet", corrupt_parquet), None, ["in.parquet' cannot be read"]),
    ("negative-token-ids", prepare_cli("parquet", parquet_file(pa.table({
        "input_ids": fixed(np.array([[1, 2, 3, 4], [5, -1, 7, 8]])),
        "labels": fixed(np.array([[2, 3, 4, -100], [6, 7, 8, -100]]))}))), None,
     ["in.parquet' column input_ids holds -1, a negative id"]),
    ("negative-labels", prepare_cli("parquet", parquet_file(pa.table({
        "input_ids": fixed(np.array([[1, 2], [3, 4]])), "labels": fixed(np.array([[2, -100], [4, -2]]))}))), None,
     ["in.parquet' column labels holds -2", "or -100"]),
    # prepare: where it writes
    ("out-is-a-file", lambda tmp: ["data", "prepare", "--from", "text", str(text_file(TEXT)(tmp)), "--out",
                                   str(text_file(b"keep me", "notes.md")(tmp)), "--quiet"], None,
     ["notes.md' is an existing file, not a directory"]),
    ("disk-full", prepare_cli("text", text_file(TEXT)), fail_with("pyarrow.parquet.write_table", errno.ENOSPC),
     ["cannot write the dataset to", "/out': No space left on device"]),
    ("read-only-disk", prepare_cli("text", text_file(TEXT)), fail_with("raydl.storage.write_bytes", errno.EROFS),
     ["cannot write the dataset to", "/out': Read-only file system"]),
    ("read-only-disk-bpe", prepare_cli("text", text_file(TEXT * 20), "--tokenizer", "bpe", "--vocab-size", "300"),
     fail_with("raydl.storage.write_bytes", errno.EROFS), ["/out': Read-only file system"]),
    # inspect: shards and manifests from elsewhere
    ("inspect-truncated-first-shard", dataset(first_shard(truncate)), None,
     ["ds/train-00000.parquet' (the first of the train split) cannot be read"]),
    ("inspect-zero-row-first-shard", dataset(first_shard(empty)), None,
     ["ds/train-00000.parquet' (the first of the train split) has no rows"]),
    ("inspect-dotdot-shard", dataset(manifest("../../etc/passwd")), None,
     [f"{ESCAPE} = '../../etc/passwd' is not a file inside the dataset directory"]),
    ("inspect-absolute-shard", dataset(manifest("/etc/passwd")), None,
     [f"{ESCAPE} = '/etc/passwd' is not a file inside"]),
    ("inspect-symlink-out", dataset(first_shard(link_out)), None, [f"{ESCAPE} = 'train-00000.parquet' is not a file"]),
    ("inspect-tokenizer-out", dataset(manifest(tokenizer="bpe", tokenizer_file="../txt/doc0.txt")), None,
     ["entry tokenizer_file = '../txt/doc0.txt' is not a file inside"]),
    ("train-dotdot-shard", train_on(manifest("../../etc/passwd")), None,
     [f"{ESCAPE} = '../../etc/passwd' is not a file inside"]),
]


def tree(root: Path) -> dict[str, str]:
    """Everything under root: path -> sha256 of a file's bytes, 'dir', or a link's target (not followed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        if p.is_symlink():
            out[key] = f"-> {os.readlink(p)}"
        elif p.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("make_argv, inject, words", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_data_input_is_one_paragraph_exit_2_and_changes_nothing(tmp_path, monkeypatch, capsys, make_argv,
                                                                    inject, words):
    monkeypatch.chdir(tmp_path)
    argv = make_argv(tmp_path)
    before = tree(tmp_path)
    if inject:
        inject(monkeypatch)
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    message = next((ln for ln in err.splitlines() if ln.startswith("raydl: error:")), err)
    for word in words:
        assert word in message, (word, err)
    assert "Traceback" not in out + err and "Fix:" in message and message == err.strip()
    monkeypatch.undo()
    assert tree(tmp_path) == before
