"""Cache bookkeeping: shard sidecars, the manifest, checksums, and the refusals that guard them.

Layout of a cache directory (docs/cache-format.md):
    manifest.json                    written last, atomically: fingerprint, build settings, shards, totals
    shards/shard-00000.safetensors   write-once shard of consecutive sequences
    shards/shard-00000.json          its sidecar: size, sha256, sequence range, tokens, build hash
A shard counts as done only when its sidecar exists and its size and checksum match it.
"""
from __future__ import annotations

import hashlib
import json
import os

from topkd.cache.shard import FORMAT_VERSION, write_atomic

MANIFEST = "manifest.json"
FORMAT_NAME = "topkd-topk-cache"


class CacheError(ValueError):
    """A cache that is missing, corrupt or does not match what it is used with."""


def shard_path(root: str, j: int) -> str:
    return os.path.join(root, "shards", f"shard-{j:05d}.safetensors")


def sidecar_path(root: str, j: int) -> str:
    return os.path.join(root, "shards", f"shard-{j:05d}.json")


def file_sha256(path: str, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def json_sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def write_json_atomic(path: str, obj) -> None:
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def write_sidecar(root: str, j: int, nbytes: int, first_seq: int, n_seqs: int, tokens: int, build_hash: str) -> dict:
    """After the shard file is durable: its size and checksum, so a rerun can trust or redo it."""
    side = {"shard": j, "file": os.path.relpath(shard_path(root, j), root), "bytes": nbytes,
            "sha256": file_sha256(shard_path(root, j)), "sequences": [first_seq, first_seq + n_seqs],
            "tokens": tokens, "build_hash": build_hash, "format_version": FORMAT_VERSION}
    write_json_atomic(sidecar_path(root, j), side)
    return side


def read_sidecar(root: str, j: int) -> dict | None:
    try:
        with open(sidecar_path(root, j)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def check_shard(root: str, side: dict, checksum: bool = True) -> str | None:
    """None when the shard file matches its sidecar, else what is wrong (size first, then checksum)."""
    path = os.path.join(root, side["file"])
    if not os.path.exists(path):
        return f"{side['file']}: missing"
    size = os.path.getsize(path)
    if size != side["bytes"]:
        return f"{side['file']}: {size} bytes, sidecar says {side['bytes']} (truncated or overwritten)"
    if checksum and file_sha256(path) != side["sha256"]:
        return f"{side['file']}: sha256 mismatch (corrupted)"
    return None


def done_shard(root: str, j: int, build_hash: str) -> dict | None:
    """The sidecar of shard j if the shard is complete and verified for this build, else None.

    A sidecar from a different build is an error, never silently overwritten."""
    side = read_sidecar(root, j)
    if side is None:
        return None
    if side.get("build_hash") != build_hash:
        raise CacheError(f"{sidecar_path(root, j)} was written by a different build (teacher, data or settings "
                         f"differ: build hash {side.get('build_hash', '?')[:12]} vs {build_hash[:12]}); "
                         "use a new --out directory, or delete the old cache to rebuild it")
    return side if check_shard(root, side) is None else None


def write_manifest(root: str, fingerprint: dict, build: dict, sidecars: list[dict]) -> dict:
    """Last step of a build: check the shards form 0..n-1 over consecutive sequences, then write atomically."""
    for j, side in enumerate(sidecars):
        if side["shard"] != j or (j and side["sequences"][0] != sidecars[j - 1]["sequences"][1]):
            raise CacheError(f"shards are not consecutive at shard {j}; rerun the build to complete it")
    tokens = sum(s["tokens"] for s in sidecars)
    nbytes = sum(s["bytes"] for s in sidecars)
    manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "fingerprint": fingerprint,
                "build": build, "build_hash": sidecars[0]["build_hash"] if sidecars else None, "shards": sidecars,
                "totals": {"shards": len(sidecars), "sequences": sidecars[-1]["sequences"][1] if sidecars else 0,
                           "tokens": tokens, "bytes": nbytes, "bytes_per_token": nbytes / max(tokens, 1)}}
    write_json_atomic(os.path.join(root, MANIFEST), manifest)
    return manifest


def load_manifest(root: str) -> dict:
    """Read and validate manifest.json: format, version, and one build hash across all shards."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise CacheError(f"cache: expected a cache directory, got {root!r} (not a directory)")
    if not os.path.exists(path):
        raise CacheError(f"{path} is missing: the build did not finish (or this is not a cache); rerun "
                         "`topkd cache build` with the same arguments to resume it")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise CacheError(f"{path}: not valid JSON ({e}); the manifest is corrupt, rerun the build to rewrite it")
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"{path}: expected format {FORMAT_NAME} v{FORMAT_VERSION}, got "
                         f"{manifest.get('format')} v{manifest.get('format_version')}; rebuild with this topkd")
    hashes = {s.get("build_hash") for s in manifest["shards"]} | {manifest["build_hash"]}
    if len(hashes) != 1:
        raise CacheError(f"{path}: shards come from {len(hashes)} different builds (mixed fingerprints); "
                         "rebuild the cache into an empty directory")
    return manifest
