"""Resume, repair and locking of a cache build: what a rerun of `topkd cache build` finds in --out, and what it does.

    check_or_repair(out, build_hash)   # a finished cache: kept if whole, set up for repair if damaged
    finished(out, build_hash)          # its manifest, if this exact build finished (another build is refused)
    remove_stale_temps(out, j)         # temp files of shard j left by a killed process
    with build_lock(out, "0-0"): ...   # one build process per (part, rank) of an --out

A finished cache whose every shard verifies is left as it is; a damaged manifest, stored tokenizer, or a
deleted, truncated, corrupt or swapped shard is removed with the manifest, so the build redoes just those.
"""

from __future__ import annotations

import contextlib
import glob
import os

from topkd.base.files import exclusive_lock
from topkd.cache.building.compat import tokenizer_problems
from topkd.cache.format import manifest as mf


def remove_stale_temps(out: str, j: int) -> None:
    """Temp files of shard j left by a killed run (never renamed, so never trusted); a live process's are kept."""
    for path in (mf.shard_path(out, j), mf.sidecar_path(out, j)):
        for stale in glob.glob(path + ".tmp-*"):
            pid = stale.rsplit("-", 1)[-1]
            if not (pid.isdigit() and _alive(int(pid))):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stale)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def finished(root: str, build_hash: str) -> dict | None:
    """The manifest if this exact build finished; a different finished build is refused."""
    if not os.path.exists(os.path.join(root, mf.MANIFEST)):
        return None
    manifest = mf.load_manifest(root)
    _refuse_another_build(manifest, root, build_hash)
    return manifest


def _refuse_another_build(manifest: dict, root: str, build_hash: str) -> None:
    if manifest["build_hash"] != build_hash:
        raise mf.CacheError(
            f"{root} holds a finished cache from a different build (teacher, data or settings "
            "differ); use a new --out directory, or delete it to rebuild"
        )


def check_or_repair(root: str, build_hash: str) -> None:
    """A finished cache of this build whose every shard verifies is left as it is. A different finished build is
    refused; a damaged manifest, stored tokenizer, or a deleted, truncated, corrupt or swapped shard, is set up
    for repair (the bad files and the manifest removed), so the build redoes just those shards."""
    path = os.path.join(root, mf.MANIFEST)
    if not os.path.exists(path):
        return
    try:
        manifest = mf.load_manifest(root)
    except mf.CacheError as e:
        print(
            f"cache build: {e}; repairing: the manifest is rewritten from the verified shards",
            flush=True,
        )
        os.remove(path)
        return
    _refuse_another_build(manifest, root, build_hash)
    damaged_tokenizer = tokenizer_problems(root, manifest)
    if damaged_tokenizer:
        print(
            f"cache build: {damaged_tokenizer[0]}; repairing: the tokenizer and the manifest are rewritten",
            flush=True,
        )
        os.remove(path)
    bad = [
        j
        for j in range(len(manifest["shards"]))
        if mf.done_shard(root, j, build_hash, foreign="redo") is None
    ]
    if not bad:
        return
    print(
        f"cache build: {len(bad)} shard(s) of {root} are missing or damaged ({', '.join(map(str, bad[:10]))}); "
        "repairing: redoing them",
        flush=True,
    )
    for j in bad:
        for stale in (mf.shard_path(root, j), mf.sidecar_path(root, j)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
    with contextlib.suppress(FileNotFoundError):  # already gone when the tokenizer was damaged too
        os.remove(path)


def build_lock(out: str, who: str):
    """One build process per (part, rank) of an --out: a second identical build is refused at once, never
    left to delete or overwrite the first one's files."""
    return exclusive_lock(
        os.path.join(out, f".build-{who}.lock"),
        f"{out}: another build is writing there (process {{holder}} holds {{path}}); wait for it "
        "to finish, or build into another --out",
    )
