"""Files every layer writes or checks: atomic writes (temp file, fsync, rename, fsync the directory) and sha256.

    write_atomic(path, data)         # the file exists whole (old or new) or not at all, whatever happens
    file_sha256(path)                # hex digest of a file's bytes, read in 4 MiB blocks
    json_sha256(obj)                 # hex digest of sorted-key JSON (hashes of settings and fingerprints)

Caches (shards, sidecars, manifests), checkpoints and run records all go through these, so a
crash, a signal or a full disk never leaves a half-written file that a later run would trust.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no stray temp file, the old file (if any) untouched
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)  # the rename itself must survive a crash


def write_json_atomic(path: str, obj) -> None:
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: str, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def json_sha256(obj) -> str:
    """sha256 of the sorted-key JSON of obj; values JSON cannot hold are hashed by their str()."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def json_file_sha256(path: str) -> str:
    """sha256 of a JSON file's content (sorted keys), so formatting does not change it."""
    with open(path) as f:
        return json_sha256(json.load(f))
