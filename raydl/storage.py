"""Locations: a local path or a URI (s3://, gs://, file://, hdfs://, any fsspec protocol) as (filesystem, path).

    fs, path = storage.resolve("s3://bucket/ds", "data.path")   # pyarrow's S3FileSystem, "bucket/ds"
    storage.uri(fs, path)                                        # "s3://bucket/ds": the scheme is kept
    storage.check("s3://bucket/ckpt", "checkpoint.storage_path") # the bucket exists and answers, or exit 2

Every command that takes a location (data prepare --out, data inspect, data.path, data.cache_dir,
checkpoint.storage_path, --resume, export, report) goes through `resolve`, so a URI never becomes a
local directory named `s3:`. pyarrow opens s3://, gs:// (gcs://), hdfs:// and file:// itself; any
other scheme goes through fsspec when an fsspec implementation of it is installed. An S3 endpoint
other than AWS (MinIO, moto, Ceph) is given by AWS_ENDPOINT_URL, which pyarrow reads, not in the URI,
so that a URI written down (`uri`) opens the same bucket again.

Object stores have no atomic rename: a dataset is complete once its manifest, written last, is there
(raydl.data.prepare); a checkpoint once every rank's files verify (raydl.train.checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from raydl.errors import RaydlError, one_line

# pyarrow's type_name -> the scheme of its URIs
SCHEMES = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs"}
# Non-secret settings of the object stores that Ray workers need to reach the same bucket as the driver
# (credentials come from each node's own chain: an instance role, its environment, ~/.aws).
FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION")


class StorageError(RaydlError, ValueError):
    """A location raydl cannot open or write: unknown scheme, no such bucket, no credentials."""


def is_uri(location: str) -> bool:
    return "://" in str(location)


def is_local(location: str) -> bool:
    return not is_uri(location) or str(location).startswith("file://")


def resolve(location: str, field: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) of `location`; a StorageError naming `field` if no filesystem opens it."""
    location = str(location)
    if not is_uri(location):
        return pafs.LocalFileSystem(), location
    try:
        return pafs.FileSystem.from_uri(location)
    except pa.ArrowInvalid as e:
        if "Unrecognized filesystem type" not in str(e):
            raise _error(field, location, f"is not a URI pyarrow can open ({one_line(e)})",
                         "write it as SCHEME://BUCKET/PATH with no query string (an S3 endpoint goes in "
                         "AWS_ENDPOINT_URL)") from None
    except OSError as e:   # s3:// without a region asks AWS for the bucket's
        raise _unreachable(field, location, e) from None
    return _fsspec(location, field)


def _fsspec(location: str, field: str) -> tuple[pafs.FileSystem, str]:
    """A scheme pyarrow lacks (memory://, az://, ...) through fsspec's implementation of it."""
    import fsspec

    scheme = location.split("://", 1)[0]
    try:
        fs = fsspec.filesystem(scheme)
    except (ValueError, ImportError) as e:
        raise _error(field, location, f"has the scheme {scheme}://, which raydl cannot open ({one_line(e)})",
                     "use a local path, s3://, gs://, hdfs:// or file://, or install the fsspec package for "
                     f"{scheme}://") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), fs._strip_protocol(location)


def uri(fs: pafs.FileSystem, path: str) -> str:
    """The location of `path` in `fs` as a URI with its scheme (a plain path for local files): what
    raydl writes down, so that reading it back opens the same place (Ray's Checkpoint.path lacks the scheme)."""
    if isinstance(fs, pafs.SubTreeFileSystem):
        return uri(fs.base_fs, f"{fs.base_path.rstrip('/')}/{path.lstrip('/')}")
    if isinstance(fs, pafs.LocalFileSystem):
        return path
    if isinstance(fs, pafs.PyFileSystem) and isinstance(fs.handler, pafs.FSSpecHandler):
        protocol = fs.handler.fs.protocol
        return f"{protocol if isinstance(protocol, str) else protocol[0]}://{path}"
    return f"{SCHEMES.get(fs.type_name, fs.type_name)}://{path}"


def join(location: str, *parts: str) -> str:
    """`location`/part/...: os.path.join for local paths, '/' for URIs."""
    if not is_uri(location):
        return os.path.join(location, *parts)
    return "/".join([str(location).rstrip("/"), *(p.strip("/") for p in parts)])


def run_checkpoints(storage_path: str, run_dir: str | os.PathLike, run_id: str) -> tuple[str, str]:
    """(storage_path, name): where a run's checkpoints go, storage_path/name/step_N, whichever launcher runs it
    (Ray Train's RunConfig takes the two apart). Without a storage path: the run directory's train/."""
    if not storage_path:
        return str(run_dir), "train"
    # A shared storage path holds many runs: the run id keeps two runs of one basename apart.
    return storage_path, f"{os.path.basename(os.fspath(run_dir).rstrip('/'))}-{run_id}"


def check(location: str, field: str) -> tuple[pafs.FileSystem, str]:
    """`resolve`, and for an object store also that its bucket exists and answers with these credentials:
    before Ray starts and before anything is written, not as a failed upload at the first checkpoint."""
    fs, path = resolve(location, field)
    if isinstance(fs, pafs.LocalFileSystem):
        return fs, path
    bucket = path.split("/", 1)[0]
    try:
        found = fs.get_file_info(bucket).type != pafs.FileType.NotFound
    except OSError as e:
        raise _unreachable(field, location, e) from None
    if not found:
        raise _error(field, location, f"names the bucket '{bucket}', which does not exist",
                     "create the bucket first, or fix its name")
    return fs, path


def _unreachable(field: str, location: str, error: OSError) -> StorageError:
    return _error(field, location, f"cannot be reached ({one_line(error)[:300]})",
                  "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an instance role for s3://, "
                  "GOOGLE_APPLICATION_CREDENTIALS for gs://), the region (AWS_DEFAULT_REGION) and the endpoint "
                  "(AWS_ENDPOINT_URL)")


def _error(field: str, location: str, problem: str, fix: str) -> StorageError:
    return StorageError(f"{field} '{location}' {problem}. Fix: {fix}; nothing was written.")


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """One object written whole: an object store shows it only once the upload completes."""
    with fs.open_output_stream(path) as f:
        f.write(data)


def remove_dir(fs: pafs.FileSystem, path: str) -> None:
    """Remove what a failed or interrupted writing left there (nothing, when it had written nothing)."""
    try:
        fs.delete_dir(path)
    except OSError:
        pass


def is_empty_or_missing(fs: pafs.FileSystem, path: str) -> bool:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return True
    return info.type == pafs.FileType.Directory and not fs.get_file_info(pafs.FileSelector(path))


@contextlib.contextmanager
def local_copy(location: str, field: str, *, only: tuple[str, ...] = ()) -> Iterator[str]:
    """A local directory holding what `location` holds: itself if local, else a download of the same name,
    removed afterwards (checkpoints are verified and loaded by code that works on local files: DCP, sha256
    of files). `only`: download just the files of these names, wherever they are below `location`."""
    fs, path = resolve(location, field)
    if isinstance(fs, pafs.LocalFileSystem):
        yield path
        return
    scratch = tempfile.mkdtemp(prefix="raydl-download-")
    local = os.path.join(scratch, os.path.basename(path.rstrip("/")))
    try:
        download_dir(fs, path, local, only=only)
        yield local
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def download_dir(fs: pafs.FileSystem, path: str, local: str, *, only: tuple[str, ...] = ()) -> None:
    """Copy the files below `path` in `fs` into the local directory `local` (nothing if `path` is absent); `only`:
    just the files of these names. An object key is any string: one that would land outside `local` is skipped."""
    root = os.path.realpath(local)
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
        target = os.path.realpath(os.path.join(root, os.path.relpath(info.path, path)))
        if info.type != pafs.FileType.File or (only and info.base_name not in only) or \
                not target.startswith(root + os.sep):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        pafs.copy_files(info.path, target, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())


def upload_dir(local: str, fs: pafs.FileSystem, path: str, *, last: str | None = None) -> None:
    """Copy the local directory `local` to `path` in `fs`, file by file (streamed, not held in memory); the file
    named `last` (a dataset's manifest.json) only once every other file is there."""
    names = [os.path.relpath(os.path.join(d, f), local) for d, _, files in os.walk(local) for f in files]
    for name in sorted(names, key=lambda n: n == last):
        pafs.copy_files(os.path.join(local, name), f"{path.rstrip('/')}/{name}",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
