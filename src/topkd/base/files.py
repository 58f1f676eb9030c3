"""Files every layer writes or checks: atomic writes (temp file, fsync, rename, fsync the directory) and sha256.

    write_atomic(path, data)         # the file exists whole (old or new) or not at all, whatever happens
    refuse_links(out, ["shards"])    # names a job writes must not be symbolic links planted in its --out
    with exclusive_lock(path, busy): # one job per --out: a second is refused at once
    file_sha256(path)                # hex digest of a file's bytes, read in 4 MiB blocks
    json_sha256(obj)                 # hex digest of sorted-key JSON (hashes of settings and fingerprints)

Caches (shards, sidecars, manifests), checkpoints and run records all go through these, so a
crash, a signal or a full disk never leaves a half-written file that a later run would trust.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    # a leftover (or planted link) of that name: the name itself goes
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    try:
        with os.fdopen(
            os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb"
        ) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    # a full disk, a signal: no stray temp file, the old file (if any) untouched
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    # the rename itself must survive a crash
    fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)


def refuse_links(root: str, names) -> None:
    """Names a job writes under its --out must not be symbolic links: a planted link would make it write (or
    delete) outside --out. --out itself may be a link (a scratch file system); links inside it are refused."""
    for name in names:
        path = os.path.join(root, name)
        if os.path.islink(path):
            raise ValueError(
                f"{path}: expected a file or directory this job writes, got a symbolic link (to "
                f"{os.readlink(path)!r}); topkd never writes through links: remove the link, or use "
                "another --out"
            )


@contextlib.contextmanager
def exclusive_lock(path: str, busy: str):
    """Hold a lock on `path` (created; never followed through a link) for the block. Taken already by another
    process: ValueError(busy.format(holder=its pid, path=path)) at once. A POSIX record lock (lockf), not flock:
    forked children (DataLoader workers) do not inherit it, so a killed job's orphaned workers cannot keep its
    --out locked; the kernel releases it when the process dies, so no stale lock is ever left behind."""
    refuse_links(os.path.dirname(path), [os.path.basename(path)])
    with os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+") as f:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES, by platform
            raise ValueError(busy.format(holder=f.read().strip() or "?", path=path)) from None
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


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
