"""Cache bookkeeping: shard sidecars, the manifest, checksums, and the refusals that guard them.

Layout of a cache directory (docs/cache-format.md):
    manifest.json                    written last, atomically: fingerprint, build settings, shards, totals
    shards/shard-00000.safetensors   write-once shard of consecutive sequences
    shards/shard-00000.json          its sidecar: size, sha256, sequence range, tokens, build hash
A shard counts as done only when its sidecar exists and its size and checksum match it.
"""

from __future__ import annotations

import json
import os

from topkd.base.files import file_sha256, json_sha256, write_json_atomic
from topkd.cache.format.shard import CODECS, READABLE_VERSIONS, read_meta, read_row_counts

MANIFEST = "manifest.json"
FORMAT_NAME = "topkd-topk-cache"


class CacheError(ValueError):
    """A cache that is missing, corrupt or does not match what it is used with."""


def shard_path(root: str, j: int) -> str:
    return os.path.join(root, "shards", f"shard-{j:05d}.safetensors")


def sidecar_path(root: str, j: int) -> str:
    return os.path.join(root, "shards", f"shard-{j:05d}.json")


def build_hash(fingerprint: dict, build: dict) -> str:
    """The identity of a build: every setting and content hash that decides the cache's bytes.

    Locations are left out (the teacher's path, the data files' paths): the same teacher or data given
    as ./t, t/ or /abs/t, or moved, is the same build. Readers recompute it, so an edited setting in the
    manifest (seq_len, separator, temperatures, ...) no longer matches the shards and is refused."""
    content_fp = {key: value for key, value in fingerprint.items() if key != "teacher"}
    content_build = {
        **build,
        "data": [{k: v for k, v in d.items() if k != "path"} for d in build.get("data", [])],
    }
    return json_sha256({"fingerprint": content_fp, "build": content_build})


def write_sidecar(
    root: str,
    j: int,
    nbytes: int,
    first_seq: int,
    n_seqs: int,
    tokens: int,
    build_hash: str,
    max_id: int,
    format_version: int,
    counted: int,
) -> dict:
    """After the shard file is durable: its size and checksum, so a rerun can trust or redo it; and the largest
    token id its rows hold (input or teacher), which decides how small a student head may be."""
    side = {
        "shard": j,
        "file": os.path.relpath(shard_path(root, j), root),
        "bytes": nbytes,
        "sha256": file_sha256(shard_path(root, j)),
        "sequences": [first_seq, first_seq + n_seqs],
        "tokens": tokens,
        "build_hash": build_hash,
        "format_version": format_version,
        "max_id": max_id,
        "counted": counted,
    }
    write_json_atomic(sidecar_path(root, j), side)
    return side


def read_sidecar(root: str, j: int) -> dict | None:
    """Shard j's sidecar, or None when it is missing or damaged (then the shard is redone)."""
    try:
        with open(sidecar_path(root, j)) as f:
            side = json.load(f)
        check_sidecar(side, j)
        return side
    except (OSError, ValueError):  # json.JSONDecodeError and CacheError are ValueErrors
        return None


def check_sidecar(side, j: int, where: str = "sidecar") -> None:
    """A sidecar's structure: the fields of docs/cache-format.md with their types, and shard j's own file name."""
    need(isinstance(side, dict), f"{where}: expected a JSON object, got {type(side).__name__}")
    need(
        side.get("shard") == j and side.get("file") == shard_name(j),
        f"{where}: expected shard {j} in file {shard_name(j)!r}, got shard {side.get('shard')!r} in "
        f"{side.get('file')!r}",
    )
    need(
        _is_int(side.get("bytes"), 0) and _is_int(side.get("tokens"), 0),
        f"{where}: expected integer bytes and "
        f"tokens >= 0, got {side.get('bytes')!r} and {side.get('tokens')!r}",
    )
    need(
        _is_hex(side.get("sha256")) and _is_hex(side.get("build_hash")),
        f"{where}: expected sha256 and build_hash as 64 hex digits",
    )
    seqs = side.get("sequences")
    need(
        isinstance(seqs, list)
        and len(seqs) == 2
        and all(_is_int(v, 0) for v in seqs)
        and seqs[0] < seqs[1],
        f"{where}: expected sequences [first, end) with 0 <= first < end, got {seqs!r}",
    )
    need(
        side.get("format_version") in READABLE_VERSIONS,
        f"{where}: expected format_version in "
        f"{READABLE_VERSIONS}, got {side.get('format_version')!r}",
    )
    for key in ("max_id", "counted"):  # absent in caches built before they were recorded
        need(
            key not in side or _is_int(side[key], 0),
            f"{where}: expected {key} as an integer >= 0, got {side.get(key)!r}",
        )


def shard_name(j: int) -> str:
    return f"shards/shard-{j:05d}.safetensors"


def need(ok: bool, message: str) -> None:
    if not ok:
        raise CacheError(message)


def _is_int(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_hex(value) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def check_shard(root: str, side: dict, checksum: bool = True) -> str | None:
    """None when the shard file matches its sidecar, else what is wrong (place, size, then checksum).

    `side` has passed check_sidecar, so its file is the canonical name; it is never opened through a link
    out of the cache directory: nothing about files elsewhere is read or reported."""
    path = os.path.join(root, side["file"])
    inside = os.path.realpath(os.path.join(root, "shards")) + os.sep
    if not os.path.realpath(path).startswith(inside):
        return f"{side['file']}: not a plain file of this cache's shards/ directory (refused)"
    if not os.path.isfile(path):
        return f"{side['file']}: missing"
    size = os.path.getsize(path)
    if size != side["bytes"]:
        return (
            f"{side['file']}: {size} bytes, sidecar says {side['bytes']} (truncated or overwritten)"
        )
    if checksum and file_sha256(path) != side["sha256"]:
        return f"{side['file']}: sha256 mismatch (corrupted)"
    return None


def identity_problem(meta: dict, side: dict, build: str) -> str | None:
    """None when a shard's own metadata (inside its checksummed bytes) says it is this shard of this build."""
    want = {
        "format_version": str(side.get("format_version")),
        "build_hash": build,
        "shard": str(side["shard"]),
        "sequences": f"{side['sequences'][0]},{side['sequences'][1]}",
    }
    wrong = [key for key, value in want.items() if meta.get(key) != value]
    if wrong:
        return (
            f"{side['file']}: its own metadata says {', '.join(f'{k}={meta.get(k)!r}' for k in wrong)}, expected "
            f"{', '.join(f'{k}={want[k]!r}' for k in wrong)} (a shard from another cache, build or position)"
        )
    return None


def done_shard(root: str, j: int, build: str, foreign: str = "refuse") -> dict | None:
    """The sidecar of shard j if the shard is complete and verified for this build, else None.

    A sidecar from a different build is an error (foreign="refuse": another build's files are never
    overwritten) unless the shard's own checksummed metadata says it is this build's (then the sidecar is what
    is damaged: one shard is redone, not the whole --out refused), or, when repairing a cache whose manifest
    names this build (foreign="redo"), damage. A sidecar whose token or counted rows differ from the shard's
    own is damaged too: redone, so a rerun repairs what the reader refuses."""
    side = read_sidecar(root, j)
    if side is None:
        return None
    if check_shard(root, side) is not None:
        return None
    try:
        meta = read_meta(os.path.join(root, side["file"]))
        rows, counted = read_row_counts(os.path.join(root, side["file"]))
    except Exception:  # noqa: BLE001 - safetensors raises its own error type: any unreadable shard is redone
        return None
    if side["build_hash"] != build:
        if foreign == "redo" or meta.get("build_hash") == build:
            return None
        raise CacheError(
            f"{sidecar_path(root, j)} was written by a different build (teacher, data or settings "
            f"differ: build hash {side['build_hash'][:12]} vs {build[:12]}); "
            "use a new --out directory, or delete the old cache to rebuild it"
        )
    if rows != side["tokens"] or counted != side.get("counted", counted):
        return None
    return side if identity_problem(meta, side, build) is None else None


def write_manifest(
    root: str,
    fingerprint: dict,
    build: dict,
    sidecars: list[dict],
    tokenizer_files: dict | None = None,
) -> dict:
    """Last step of a build: check the shards form 0..n-1 over consecutive sequences, then write atomically.
    tokenizer_files: size and sha256 of each file of the stored teacher tokenizer (root/tokenizer)."""
    for j, side in enumerate(sidecars):
        if side["shard"] != j or (j and side["sequences"][0] != sidecars[j - 1]["sequences"][1]):
            raise CacheError(
                f"shards are not consecutive at shard {j}; rerun the build to complete it"
            )
    tokens = sum(s["tokens"] for s in sidecars)
    nbytes = sum(s["bytes"] for s in sidecars)
    version = max((s["format_version"] for s in sidecars), default=min(READABLE_VERSIONS))
    manifest = {
        "format": FORMAT_NAME,
        "format_version": version,
        "fingerprint": fingerprint,
        "build": build,
        "build_hash": sidecars[0]["build_hash"] if sidecars else None,
        "shards": sidecars,
        "totals": {
            "shards": len(sidecars),
            "sequences": sidecars[-1]["sequences"][1] if sidecars else 0,
            "tokens": tokens,
            "bytes": nbytes,
            "bytes_per_token": nbytes / max(tokens, 1),
        },
    }
    if tokenizer_files is not None:
        manifest["tokenizer_files"] = tokenizer_files
    write_json_atomic(os.path.join(root, MANIFEST), manifest)
    return manifest


def load_manifest(root: str) -> dict:
    """Read and validate manifest.json: its whole structure, the build hash recomputed from its settings,
    and one build hash across all shards. Any problem is a CacheError naming the field."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise CacheError(f"cache: expected a cache directory, got {root!r} (not a directory)")
    if not os.path.exists(path):
        raise CacheError(
            f"{path} is missing: the build did not finish (or this is not a cache); rerun "
            "`topkd cache build` with the same arguments to resume it"
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CacheError(
            f"{path}: not valid JSON ({e}); the manifest is corrupt, rerun the build to rewrite it"
        )
    check_manifest(manifest, path)
    return manifest


def check_manifest(m, path: str) -> None:
    """Every field the readers use, with its type and range; the shards consecutive; the hashes consistent."""
    need(
        isinstance(m, dict),
        f"{path}: expected a JSON object, got {type(m).__name__}; rerun the build to rewrite it",
    )
    if m.get("format") != FORMAT_NAME or m.get("format_version") not in READABLE_VERSIONS:
        raise CacheError(
            f"{path}: expected format {FORMAT_NAME} version {' or '.join(map(str, READABLE_VERSIONS))}, "
            f"got {m.get('format')} v{m.get('format_version')}; rebuild with this topkd"
        )
    fp, build, shards, totals = (m.get(key) for key in ("fingerprint", "build", "shards", "totals"))
    need(
        all(isinstance(x, dict) for x in (fp, build, totals)) and isinstance(shards, list),
        f"{path}: expected objects fingerprint, build, totals and a list shards; the manifest is damaged, rerun "
        "the build to rewrite it",
    )
    _check_fingerprint(fp, path)
    _check_build(build, path)
    need(
        _is_hex(m.get("build_hash")),
        f"{path}: expected build_hash as 64 hex digits, got {m.get('build_hash')!r}",
    )
    if build_hash(fp, build) != m["build_hash"]:
        raise CacheError(
            f"{path}: its fingerprint or build settings were changed after the build (the build hash "
            "recomputed from them differs from the one the shards were written with); restore the "
            "manifest, or rebuild the cache"
        )
    end = _check_shard_list(shards, m["build_hash"], path)
    # write_manifest: the newest of its shards' versions
    version = max((s["format_version"] for s in shards), default=m["format_version"])
    need(
        m["format_version"] == version,
        f"{path}: format_version {m['format_version']} does not match its shards' (v{version}, the newest "
        "of them); the manifest was edited: rerun the build command to rewrite it",
    )
    _check_file_sums(m.get("tokenizer_files", {}), f"{path}: tokenizer_files")
    want = {
        "shards": len(shards),
        "sequences": end,
        "tokens": sum(s["tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
    }
    wrong = {key: totals.get(key) for key, value in want.items() if totals.get(key) != value}
    need(
        not wrong,
        f"{path}: totals {wrong} do not match the shards ({ {k: want[k] for k in wrong} })",
    )


def _check_shard_list(shards: list, manifest_hash: str, path: str) -> int:
    """Each sidecar whole, the shards consecutive from sequence 0 and all of this build; returns the sequences."""
    end = 0
    for j, side in enumerate(shards):
        check_sidecar(side, j, where=f"{path}: shards[{j}]")
        need(
            side["sequences"][0] == end,
            f"{path}: shards[{j}] starts at sequence {side['sequences'][0]}, "
            f"expected {end} (shards must be consecutive)",
        )
        end = side["sequences"][1]
    hashes = {s["build_hash"] for s in shards} | {manifest_hash}
    if len(hashes) != 1:
        raise CacheError(
            f"{path}: shards come from {len(hashes)} different builds (mixed fingerprints); "
            "rebuild the cache into an empty directory"
        )
    return end


def file_sums(directory: str) -> dict:
    """{name: {bytes, sha256}} of the plain files of a directory (the stored tokenizer)."""
    return {
        name: {"bytes": os.path.getsize(p), "sha256": file_sha256(p)}
        for name in sorted(os.listdir(directory))
        if os.path.isfile(p := os.path.join(directory, name))
    }


def file_sums_problems(directory: str, sums: dict, label: str) -> list[str]:
    """What differs between a directory's files and their recorded sums (missing, extra, size, checksum)."""
    if not os.path.isdir(directory) or os.path.islink(directory):
        return [f"{label}: missing (or not a plain directory)"]
    names = set(os.listdir(directory))
    problems = [f"{label}/{n}: missing" for n in sorted(set(sums) - names)]
    problems += [
        f"{label}/{n}: not recorded by the build (added after it)"
        for n in sorted(names - set(sums))
    ]
    for name in sorted(set(sums) & names):
        path = os.path.join(directory, name)
        if os.path.islink(path) or not os.path.isfile(path):
            problems.append(f"{label}/{name}: not a plain file")
        elif (
            os.path.getsize(path) != sums[name]["bytes"]
            or file_sha256(path) != sums[name]["sha256"]
        ):
            problems.append(
                f"{label}/{name}: size or sha256 differs from the build's (edited or damaged)"
            )
    return problems


def _check_file_sums(sums, where: str) -> None:
    need(
        isinstance(sums, dict)
        and all(
            _plain_name(n)
            and isinstance(v, dict)
            and _is_int(v.get("bytes"), 0)
            and _is_hex(v.get("sha256"))
            for n, v in sums.items()
        ),
        f"{where}: expected {{file name: {{bytes, sha256}}}}, got {str(sums)[:80]}; rerun the build to rewrite it",
    )


def _plain_name(n) -> bool:
    """A file name with no directory part (nothing that walks out of the cache)."""
    return isinstance(n, str) and n not in ("", ".", "..") and "/" not in n


def _check_fingerprint(fp: dict, path: str) -> None:
    for key in ("teacher", "tokenizer_sha256", "dtype", "engine", "alignment"):
        need(
            isinstance(fp.get(key), str),
            f"{path}: fingerprint.{key}: expected a string, got {fp.get(key)!r}",
        )
    vocab, k, temps = fp.get("vocab_size"), fp.get("k"), fp.get("temperatures")
    need(
        _is_int(vocab, 1) and _is_int(k, 1) and k <= vocab,
        f"{path}: fingerprint: expected integers "
        f"1 <= k <= vocab_size, got k={k!r} vocab_size={vocab!r}",
    )
    need(
        isinstance(temps, list)
        and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in temps),
        f"{path}: fingerprint.temperatures: expected a list of numbers > 0, got {temps!r}",
    )


def _check_build(build: dict, path: str) -> None:
    need(
        _is_int(build.get("seq_len"), 2),
        f"{path}: build.seq_len: expected an integer >= 2, got {build.get('seq_len')!r}",
    )
    need(
        build.get("codec") in CODECS,
        f"{path}: build.codec: expected one of {CODECS}, got {build.get('codec')!r}",
    )
    sep = build.get("separator")
    need(
        sep is None or _is_int(sep, 0),
        f"{path}: build.separator: expected a token id or null, got {sep!r}",
    )
    data = build.get("data")
    need(
        isinstance(data, list) and all(isinstance(d, dict) for d in data),
        f"{path}: build.data: expected a list of objects, got {type(data).__name__}",
    )
