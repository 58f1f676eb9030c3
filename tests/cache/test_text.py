"""Format version 6 in a built cache: each sequence's text and token spans, read back, checked, refused when bad."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from topkd.cache import TopKCache
from topkd.cache.format.shard import ShardError


def test_a_cache_built_from_text_records_it(documents_cache, documents_file, teacher_dir):
    """The sequences' texts, in order, are the documents' texts; each token's span spells it in the teacher's
    tokenizer (the ids are re-made from the spans), and the separator between documents owns nothing."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    texts = [json.loads(line)["text"] for line in open(documents_file)]
    seqs = [documents_cache.sequence(i) for i in range(len(documents_cache))]
    assert documents_cache.has_text and documents_cache.manifest["format_version"] == 6
    assert "".join(s.text for s in seqs) == "".join(texts)
    for s in seqs:
        ends = np.cumsum(s.char_len)
        for t, a, e in zip(s.input_ids, np.concatenate([[0], ends[:-1]]), ends):
            if t == tok.eos_token_id:
                assert a == e
            elif e > a:  # a token owning characters re-tokenises to itself or begins its span
                assert tok(s.text[a:e], add_special_tokens=False)["input_ids"][0] == t


def _rewrite_shard(root: str, edit) -> None:
    """Change a shard's tensors and re-record its size and checksum, as a careful attacker would."""
    from topkd.base.files import file_sha256

    path = os.path.join(root, "shards", "shard-00000.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    manifest_path = os.path.join(root, "manifest.json")
    m = json.load(open(manifest_path))
    side = m["shards"][0]
    m["totals"]["bytes"] += os.path.getsize(path) - side["bytes"]
    side.update(bytes=os.path.getsize(path), sha256=file_sha256(path))
    json.dump(side, open(os.path.join(root, "shards", "shard-00000.json"), "w"))
    json.dump(m, open(manifest_path, "w"))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t["char_len"].__setitem__(0, t["char_len"][0] + 1), "owned lengths sum to"),
        (lambda t: t["text_utf8"].__setitem__(0, 0xFF), "is not UTF-8"),
        (lambda t: t.update(text_offsets=t["text_offsets"][:-1]), "text_offsets must rise"),
    ],
)
def test_a_damaged_text_is_refused_as_corrupt(documents_cache, tmp_path, edit, match):
    root = str(tmp_path / "c")
    shutil.copytree(documents_cache.path, root)
    _rewrite_shard(root, edit)
    with pytest.raises(ShardError, match=match):
        TopKCache(root, verify_reads=False).sequence(0)


def test_ids_without_text_make_a_cache_without_it(teacher_dir, tmp_path):
    """A .npy token stream has no text: its cache keeps the old layout and says it has none."""
    from tests.conftest import cache_config
    from topkd.cache import build

    np.save(tmp_path / "ids.npy", np.arange(200).astype(np.int64) % 300)
    build(cache_config(teacher_dir, str(tmp_path / "ids.npy"), tmp_path / "c"))
    cache = TopKCache(str(tmp_path / "c"))
    assert not cache.has_text and cache.manifest["format_version"] == 2
    assert cache.sequence(0).text is None
