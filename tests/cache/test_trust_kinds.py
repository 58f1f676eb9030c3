"""Damage to formats 4 and 5 (sampled, hybrid and top-p caches) is refused in one line naming the shard.

    python -m pytest tests/cache/test_trust_kinds.py     # ~1 min: four tiny caches, then each damage on each

A damaged header key (one flipped letter, checksums then wrong; or rewritten with matching checksums) gave a
bare KeyError in `cache verify`, `cache inspect` and `train`; a rewritten frame with a width-0 row decoded to NaN
log-probs and ids >= V, and `topkd eval --cache` crashed with an IndexError. Every such shard is now refused by
the decoder, with the shard, sequence and row named, and the remedy.
"""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import zstandard
from safetensors.numpy import load_file

from tests.conftest import cache_config
from topkd.cache import TopKCache, build
from topkd.cache.format.codec import PAD_CODE
from topkd.cache.format.shard import ShardError, ShardReader, write_shard
from topkd.cli import main

KINDS = {  # name -> (build options, the header keys a decode of it reads)
    "sampled": (
        {"targets": "sampled", "samples": 16},
        ["codec", "k", "vocab", "rice_b_table", "samples"],
    ),
    "hybrid": ({"targets": "sampled", "samples": 16, "head": 4}, ["codec", "k", "rice_b_table"]),
    "topp": (
        {"targets": "topp", "top_p": 0.9, "min_k": 2},
        ["codec", "k", "vocab", "rice_b_table"],
    ),
    "topp-v4": (
        {"targets": "topp", "top_p": 0.9, "min_k": 2, "codec": "rice"},
        ["codec", "k", "rice_b"],
    ),
}
SHARD = os.path.join("shards", "shard-00000.safetensors")


@pytest.fixture(scope="module")
def caches(teacher_dir, text_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("trust-kinds")
    for kind, (options, _) in KINDS.items():
        build(
            cache_config(
                teacher_dir, text_file, root / kind, temperatures=[], max_sequences=8, **options
            )
        )
    return root


@pytest.fixture
def copy_of(caches, tmp_path):
    return lambda kind: str(shutil.copytree(caches / kind, tmp_path / kind))


def rewrite_shard(root: str, edit_meta=None, edit_arrays=None) -> None:
    """Shard 0 rewritten as a writer bug or a hand edit would: content changed, size and sha256 recorded anew."""
    path = os.path.join(root, SHARD)
    arrays = load_file(path)
    meta = json.loads(arrays.pop("meta_json").tobytes())
    if edit_meta:
        edit_meta(meta)
    if edit_arrays:
        edit_arrays(arrays, meta)
    nbytes = write_shard(path, arrays, meta)
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    side_path = os.path.join(root, "shards", "shard-00000.json")
    side = json.load(open(side_path))
    side.update(bytes=nbytes, sha256=digest)
    json.dump(side, open(side_path, "w"))
    manifest = json.load(open(os.path.join(root, "manifest.json")))
    manifest["totals"]["bytes"] += nbytes - manifest["shards"][0]["bytes"]
    manifest["shards"][0].update(bytes=nbytes, sha256=digest)
    json.dump(manifest, open(os.path.join(root, "manifest.json"), "w"))


def flip_key(root: str, key: str) -> None:
    """One letter of a header key changed in place: a random bit flip's effect, the checksums now wrong."""
    path = os.path.join(root, SHARD)
    data = open(path, "rb").read()
    needle = f'"{key}": '.encode()
    assert data.count(needle) == 1
    at = data.index(needle) + 1
    open(path, "wb").write(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])


def one_line_refusal(argv, capsys) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code in (1, 2) and "Traceback" not in captured.err
    return captured.out + captured.err


CASES = [(kind, key) for kind, (_, keys) in KINDS.items() for key in keys]


@pytest.mark.parametrize("kind,key", CASES, ids=[f"{k}-{key}" for k, key in CASES])
@pytest.mark.parametrize("how", ["bitflip", "rewritten"])
def test_a_damaged_header_key_is_one_line_in_verify_inspect_and_train(
    copy_of, kind, key, how, tmp_path, capsys
):
    root = copy_of(kind)
    if how == "bitflip":
        flip_key(root, key)
    else:
        rewrite_shard(root, edit_meta=lambda meta: meta.pop(key))
    verify = one_line_refusal(["cache", "verify", root], capsys)
    assert "BAD" in verify and "shard-00000.safetensors" in verify and "FAILED" in verify
    if how == "bitflip":
        assert "sha256 mismatch" in verify
    for argv in (
        ["cache", "inspect", root],
        [
            "train",
            "--cache",
            root,
            "--out",
            str(tmp_path / "run"),
            "--init-from-teacher",
            "--layers",
            "1",
            "--steps",
            "1",
        ],
    ):
        said = one_line_refusal(argv, capsys)
        assert "shard-00000.safetensors" in said and "rerun the build command" in said
        assert "does not parse" in said and (how == "rewritten" or "sha256 mismatch" in said)


def _frame_edit(edit):
    """Sequence 0's zstd frame decompressed, edited, re-compressed (its offsets kept consistent)."""

    def apply(arrays, meta):
        offsets = arrays["frame_offsets"]
        first = bytearray(
            zstandard.ZstdDecompressor().decompress(arrays["zstd_frames"][: offsets[1]].tobytes())
        )
        n = int(arrays["seq_rows"][1])
        frame = zstandard.ZstdCompressor().compress(bytes(edit(first, n)))
        rest = arrays["zstd_frames"][offsets[1] :]
        arrays["zstd_frames"] = np.concatenate([np.frombuffer(frame, np.uint8), rest])
        arrays["frame_offsets"] = (offsets - offsets[1] + len(frame)).astype(np.int64)
        arrays["frame_offsets"][0] = 0

    return apply


def _width_zero(raw: bytearray, n: int) -> bytearray:
    raw[2 * n + 3] = (
        0  # log-prob rows: n float16 scales, then one width byte per row; row 3 now empty
    )
    return raw


@pytest.mark.parametrize("kind", ["hybrid", "topp"])
def test_a_rewritten_width_0_row_is_refused_by_the_decoder_and_by_eval(
    copy_of, kind, tmp_path, capsys
):
    root = copy_of(kind)
    rewrite_shard(root, edit_arrays=_frame_edit(_width_zero))
    with pytest.raises(ValueError, match="zstd frame of sequence 0: row 3 holds no entry"):
        ShardReader(os.path.join(root, SHARD)).sequence(0)
    with pytest.raises(ValueError, match="row 3 holds no entry; the shard is corrupt"):
        TopKCache(root)[0]
    said = one_line_refusal(["eval", "--model", _student(tmp_path, root), "--cache", root], capsys)
    assert "row 3 holds no entry" in said and "shard-00000.safetensors" in said


def _student(tmp_path, root) -> str:
    """A model with the teacher's vocabulary for eval --cache: the cache's own teacher."""
    return TopKCache(root).teacher_dir


def test_frame_offsets_that_do_not_cut_the_stream_are_refused(copy_of):
    root = copy_of("sampled")

    def shift(arrays, meta):
        arrays["frame_offsets"] = arrays["frame_offsets"] + np.int64(1)

    rewrite_shard(root, edit_arrays=shift)
    with pytest.raises(ValueError, match="frame_offsets must rise from 0"):
        TopKCache(root)[0]


def test_a_rice_table_of_the_wrong_size_is_refused_at_open(copy_of):
    root = copy_of("topp")
    rewrite_shard(root, edit_meta=lambda meta: meta.update(rice_b_table="3,4"))
    with pytest.raises(ValueError, match="rice_b_table: expected .* parameters"):
        TopKCache(root)


def test_a_padded_row_of_padding_only_is_refused_not_decoded_to_nan(copy_of):
    root = copy_of("topp-v4")

    def all_padding(arrays, meta):
        arrays["lp_codes"][2] = PAD_CODE

    rewrite_shard(root, edit_arrays=all_padding)
    with pytest.raises(
        ShardError, match="sequence 0, row 2 decodes to .*expected at least one finite"
    ):
        TopKCache(root)[0]


def test_ids_beyond_the_vocabulary_are_refused_with_the_row(copy_of):
    root = copy_of("topp-v4")
    # a writer that recorded a smaller V than its ids (rice codes ids independently of V)
    rewrite_shard(root, edit_meta=lambda meta: meta.update(vocab="8"))
    reader = ShardReader(os.path.join(root, SHARD))
    with pytest.raises(ShardError, match=r"sequence 0, row \d+ decodes to .*ids below V=8"):
        reader.sequence(0)
