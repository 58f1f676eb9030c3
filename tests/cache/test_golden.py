"""Golden bytes: the on-disk format of docs/cache-format.md, pinned. A change here is a format change:
bump FORMAT_VERSION, document it, and update the pins. A shard without a loss mask is still version 2, byte for
byte; one with a row_mask (chat data) is version 3."""

import hashlib
import json
import struct

import numpy as np
import pytest

from topkd.cache.format.shard import (
    FORMAT_VERSION,
    UNMASKED_VERSION,
    ShardReader,
    TeacherSequence,
    encode_shard,
    write_shard,
)

GOLDEN_SHA256 = {
    "rice": "80a142e0fe84c415a58ba4fb4224779aa21c01d8eea5a976df45125edc85ec52",
    "rice-zstd": "dc14ffc838b6dc0a525764d27b74f54e8faf50b8cd80ea3a1b79bebb33ccde70",
    "packed": "83980a9b4902f3a8f3b5f6c6a7a0edcdb8d3766ef9fa20387a289895a975a406",
}


def golden_sequences():
    ids = np.array([[7, 2, 299], [0, 1, 150], [42, 41, 40]])
    lp = np.array([[-0.5, -1.5, -2.0], [-0.1, -3.0, -9.0], [-1.5, -1.5, -1.75]], dtype=np.float32)
    mass = np.log(np.exp(lp.astype(np.float64)).sum(1))
    tail = np.log1p(-np.exp(mass))

    def seq(a: int, b: int, src: int, starts: list[int]) -> TeacherSequence:
        return TeacherSequence(
            input_ids=np.array([5, 6, 7])[a:b],
            ids=ids[a:b],
            logprobs=lp[a:b],
            log_mass=mass[a:b].astype(np.float32),
            log_tail=tail[a:b].astype(np.float32),
            logz=np.full((b - a, 1), 0.25, np.float32),
            doc_starts=np.array(starts),
            source_index=src,
            token_offset=a,
            log_mass_t=np.full((b - a, 1), -0.125, np.float32),
        )

    return [seq(0, 2, 0, [0, 1]), seq(2, 3, 1, [0])]


@pytest.mark.parametrize("codec_name", ["rice-zstd", "rice", "packed"])
def test_golden_shard_bytes(tmp_path, codec_name):
    identity = {"build_hash": "ab" * 32, "shard": 0, "sequences": "0,2"}
    arrays, meta = encode_shard(
        golden_sequences(), vocab=300, codec_name=codec_name, identity=identity, temperatures=(2.0,)
    )
    path = tmp_path / "s.safetensors"
    write_shard(str(path), arrays, meta)
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    a, b = header["meta_json"]["data_offsets"]
    meta = json.loads(data[8 + header_len + a : 8 + header_len + b])
    assert meta["format_version"] == str(UNMASKED_VERSION) == "2" and "__metadata__" not in header
    assert "row_mask" not in header  # no mask: every row counts, as in every version-2 cache
    assert (meta["build_hash"], meta["shard"], meta["sequences"], meta["temperatures"]) == (
        "ab" * 32,
        "0",
        "0,2",
        "[2.0]",
    )
    assert header["log_mass_t"]["shape"] == [3, 1]
    # rice-zstd: inside the frames
    assert codec_name == "rice-zstd" or header["lp_scale"]["dtype"] == "F16"
    assert meta["codec"] == codec_name and meta["k"] == "3" and meta["vocab"] == "300"
    if codec_name != "rice-zstd":
        assert header["lp_codes"] == {
            "dtype": "U8",
            "shape": [3, 3],
            "data_offsets": header["lp_codes"]["data_offsets"],
        }
    if codec_name == "packed":  # 9 bits per id, little-endian bit order: 7 | 2 << 9 | 299 << 18 ...
        a, b = header["ids_packed"]["data_offsets"]
        row0 = int.from_bytes(data[8 + header_len + a : 8 + header_len + a + 4], "little")
        assert (row0 & 0x1FF, (row0 >> 9) & 0x1FF, (row0 >> 18) & 0x1FF) == (7, 2, 299)
    else:
        assert meta["rice_b"] == "5"
    # one zstd frame per sequence, each starting with the zstd magic number
    if codec_name == "rice-zstd":
        a, _ = header["zstd_frames"]["data_offsets"]
        assert data[8 + header_len + a : 8 + header_len + a + 4] == bytes.fromhex("28b52ffd")
    assert hashlib.sha256(data).hexdigest() == GOLDEN_SHA256[codec_name]
    seq = ShardReader(str(path)).sequence(0)
    assert set(seq.ids[0]) == {7, 2, 299} and list(seq.doc_starts) == [0, 1]


GOLDEN_CODEC_BYTES = {  # every tensor a codec writes, as literal bytes (tests/cache/test_golden.py sequences)
    "packed": {
        "ids_packed": "0704ac04000258022a52a000",
        "lp_codes": "004864009ef2000014",
        "lp_scale": "004200420042",
    },
    "rice": {
        "id_rem": "820c00500800",
        "id_unary": "fcc70301",
        "lp_codes": "480064009ef2140000",
        "lp_scale": "004200420042",
        "unary_offsets": "000000000000000003000000000000000400000000000000",
    },
    "rice-zstd": {
        "frame_offsets": "00000000000000001e000000000000003300000000000000",
        "zstd_frames": "28b52ffd241189000000420042480064009ef2820c0050fcc70312081a5928b52ffd2408410000"
        "0042140000080001bf458b98",
    },
}


@pytest.mark.parametrize("codec_name", list(GOLDEN_CODEC_BYTES))
def test_golden_codec_tensors_byte_for_byte(codec_name):
    """The codec table (topkd/cache/format/shard_codecs.py) writes exactly these tensors and bytes. Read by hand:
    lp_scale 0x4200 is float16 3.0 (the smallest compander scale); packed row 0 holds ids 7, 2, 299 in 9-bit
    fields; rice-zstd's frames are rice's lp_scale, lp_codes, id_rem and unary bytes per sequence, zstd-framed."""
    from topkd.cache.format.shard_codecs import CODECS

    arrays, _ = encode_shard(
        golden_sequences(),
        vocab=300,
        codec_name=codec_name,
        temperatures=(2.0,),
        identity={"build_hash": "ab" * 32, "shard": 0, "sequences": "0,2"},
    )
    assert set(CODECS[codec_name].tensors) == set(GOLDEN_CODEC_BYTES[codec_name])
    assert {n: arrays[n].tobytes().hex() for n in CODECS[codec_name].tensors} == GOLDEN_CODEC_BYTES[
        codec_name
    ]
    assert np.frombuffer(bytes.fromhex("0042"), "<f2")[0] == 3.0


GOLDEN_V3_SHA256 = "0ffff4c7d8a76fcaf18661c913d969ca50f333594e579e68402f40e5efd9d3af"


def test_golden_version_3_shard_with_a_row_mask(tmp_path):
    """Version 3 adds one tensor, row_mask (uint8 per row: 1 counts for KD and CE, 0 is context only); a sequence
    without a mask in a masked shard counts every row."""
    seqs = golden_sequences()
    seqs[0].row_mask = np.array([False, True])
    identity = {"build_hash": "ab" * 32, "shard": 0, "sequences": "0,2"}
    arrays, meta = encode_shard(
        seqs, vocab=300, codec_name="rice-zstd", identity=identity, temperatures=(2.0,)
    )
    assert meta["format_version"] == str(FORMAT_VERSION) == "3"
    assert arrays["row_mask"].dtype == np.uint8 and arrays["row_mask"].tobytes().hex() == "000101"
    path = tmp_path / "s.safetensors"
    write_shard(str(path), arrays, meta)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GOLDEN_V3_SHA256
    reader = ShardReader(str(path))
    assert reader.sequence(0).row_mask.tolist() == [False, True] and reader.sequence(
        1
    ).row_mask.tolist() == [True]


GOLDEN_V4_SHA256 = "a8dcb3014b39e8e116f15acfa0b7d1418e19e92804da7fcf533c61e46afd6ea4"


def test_golden_version_4_shard_with_padding_entries(tmp_path):
    """Version 4 (rows of variable K, a sampled cache): version 3 plus padding entries. A padding entry's log-prob
    code is 255 (real codes stop at 254), its rice gap 0 after the row's real ids (sorted last), its packed id 0;
    it decodes to -inf, last in rank order, with the row's first id."""
    from topkd.cache.format.shard import VARIABLE_K_VERSION

    seqs = golden_sequences()
    seqs[0].logprobs = seqs[0].logprobs.copy()
    seqs[0].logprobs[1, 1:] = -np.inf  # row 1 keeps one real entry (id 0)
    seqs[0].log_mass[1] = seqs[0].logprobs[1, 0]
    identity = {"build_hash": "ab" * 32, "shard": 0, "sequences": "0,2"}
    arrays, meta = encode_shard(
        seqs, vocab=300, codec_name="rice", identity=identity, temperatures=(2.0,), variable_k=True
    )
    assert meta["format_version"] == str(VARIABLE_K_VERSION) == "4" and arrays[
        "row_mask"
    ].tolist() == [1, 1, 1]
    assert arrays["lp_codes"][1].tolist()[1:] == [255, 255]
    path = tmp_path / "s.safetensors"
    write_shard(str(path), arrays, meta)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GOLDEN_V4_SHA256
    for codec_name in ("rice-zstd", "rice", "packed"):
        arrays, meta = encode_shard(
            seqs,
            vocab=300,
            codec_name=codec_name,
            identity=identity,
            temperatures=(2.0,),
            variable_k=True,
        )
        write_shard(str(tmp_path / codec_name), arrays, meta)
        row = ShardReader(str(tmp_path / codec_name)).sequence(0)
        assert row.ids[1].tolist() == [0, 0, 0] and np.isneginf(row.logprobs[1, 1:]).all(), (
            codec_name
        )
        # the exact mass: one entry
        assert row.logprobs[1, 0] == pytest.approx(seqs[0].logprobs[1, 0], abs=1e-6)
        assert sorted(row.ids[0].tolist()) == [2, 7, 299] and np.isfinite(row.logprobs[0]).all()


GOLDEN_V6_SHA256 = "ebe8365ed43e6fb2bd9bbda621d4505699267985153fc0d46d3cc2b5c1e34597"


def test_golden_version_6_shard_with_text(tmp_path):
    """Version 6 is an earlier layout (layout_version) plus each sequence's text: text_utf8 (UTF-8, concatenated),
    text_offsets (bytes), char_len (int32 characters each input token owns; a separator or an overlapping
    token owns none)."""
    seqs = golden_sequences()
    seqs[0].text, seqs[0].char_len = "Fé ", np.array([2, 1])
    seqs[1].text, seqs[1].char_len = "", np.array([0])
    identity = {"build_hash": "ab" * 32, "shard": 0, "sequences": "0,2"}
    arrays, meta = encode_shard(
        seqs, vocab=300, codec_name="rice-zstd", identity=identity, temperatures=(2.0,)
    )
    assert (meta["format_version"], meta["layout_version"]) == ("6", "2")
    assert arrays["text_utf8"].tobytes() == b"F\xc3\xa9 "
    assert arrays["text_offsets"].tolist() == [0, 4, 4] and arrays["text_offsets"].dtype == np.int64
    assert arrays["char_len"].dtype == np.int32 and arrays["char_len"].tobytes().hex() == (
        "020000000100000000000000"
    )
    path = tmp_path / "s.safetensors"
    write_shard(str(path), arrays, meta)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GOLDEN_V6_SHA256
    reader = ShardReader(str(path))
    first, second = reader.sequence(0), reader.sequence(1)
    assert (first.text, first.char_len.tolist(), second.text) == ("Fé ", [2, 1], "")
    # the rows are the version-2 layout's: the same decode as the pinned version-2 shard
    plain = golden_sequences()
    v2, v2_meta = encode_shard(
        plain, vocab=300, codec_name="rice-zstd", identity=identity, temperatures=(2.0,)
    )
    assert all(np.array_equal(arrays[name], v2[name]) for name in v2)
