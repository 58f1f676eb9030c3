"""What a cache stores: the shard layout and its codecs, the manifest and checksums, the rows an engine returns,
and the table of target kinds (with how sampled and top-p rows are chosen). Imports nothing from
topkd.cache.building or topkd.cache.reading (tests/test_layers.py). The names below are the format's public
API, for tools that write or read shards themselves (topkd bench cache does); docs/cache-format.md is the
format in prose."""

from topkd.cache.format import codec, manifest
from topkd.cache.format.engine_rows import EngineRows, teacher_sequence
from topkd.cache.format.shard import (
    CODECS,
    DEFAULT_CODEC,
    ShardReader,
    TeacherSequence,
    encode_shard,
    shard_facts,
    write_shard,
)
from topkd.cache.format.targets import TARGET_KINDS

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "EngineRows",
    "ShardReader",
    "TARGET_KINDS",
    "TeacherSequence",
    "codec",
    "encode_shard",
    "manifest",
    "shard_facts",
    "teacher_sequence",
    "write_shard",
]
