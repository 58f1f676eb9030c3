"""Shared fixtures: one tiny random teacher, a text file, and a small cache built from them (session-wide).

Triton kernels run on this CPU-only suite through Triton's interpreter, which must be chosen before
triton is first imported (tests/loss/test_triton.py)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402

import pytest  # noqa: E402

from tests.cache import tiny  # noqa: E402
from topkd.cache import CacheBuildConfig, TopKCache, build  # noqa: E402
from topkd.cache.format import TARGET_KINDS  # noqa: E402


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory):
    return tiny.make_teacher(str(tmp_path_factory.mktemp("teacher")))


@pytest.fixture(scope="session")
def gguf_teacher(teacher_dir, tmp_path_factory):
    """The tiny teacher as a .gguf file (F32 tensors; its own BPE tokenizer and a chat template inside)."""
    return tiny.make_gguf_teacher(
        teacher_dir, str(tmp_path_factory.mktemp("gguf") / "teacher.gguf")
    )


@pytest.fixture(scope="session")
def chat_teacher_dir(teacher_dir, tmp_path_factory):
    """The tiny teacher with ChatML's special tokens and template (tests/cache/tiny.py)."""
    return tiny.make_chat_teacher(teacher_dir, str(tmp_path_factory.mktemp("chat-teacher")))


@pytest.fixture(scope="session")
def chats_file(tmp_path_factory):
    """20 two-turn conversations (user, assistant) of tiny-vocabulary words."""
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    talks = [
        [
            {"role": "user", "content": tiny.make_text(8, i)},
            {"role": "assistant", "content": tiny.make_text(15, 100 + i)},
        ]
        for i in range(20)
    ]
    path.write_text("".join(json.dumps({"messages": t}) + "\n" for t in talks))
    return str(path)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(tiny.make_text(1500, seed=7))
    return str(path)


def cache_config(teacher_dir, text_file, out, **kw) -> CacheBuildConfig:
    opts = dict(
        teacher=teacher_dir,
        data=[text_file],
        out=str(out),
        seq_len=48,
        targets="topk",  # the tests' caches carry c_T (temperatures), which only top-K rows can
        k=16,
        seqs_per_shard=4,
        batch_size=3,
        temperatures=[2.0],
    )
    opts.update(kw)
    if "k" not in kw and "k" not in TARGET_KINDS[opts["targets"]].flags:
        del opts["k"]  # a sampled build refuses a --k it would ignore
    return CacheBuildConfig(**opts)


@pytest.fixture(scope="session")
def built_cache(teacher_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "c"
    build(cache_config(teacher_dir, text_file, out))
    return str(out)


@pytest.fixture(scope="session")
def documents_file(tmp_path_factory):
    """JSONL documents of 2 to 150 words (some longer than a 48-token sequence)."""
    path = tmp_path_factory.mktemp("docs") / "d.jsonl"
    words = [3, 40, 7, 150, 12, 5, 60, 9, 25, 4, 80, 6, 18, 33, 2, 11]
    path.write_text("".join(json.dumps({"text": tiny.make_text(n, seed=n)}) + "\n" for n in words))
    return str(path)


@pytest.fixture(scope="session")
def documents_cache(teacher_dir, documents_file, tmp_path_factory):
    """documents_file packed 48 tokens per sequence, many documents per sequence."""
    out = tmp_path_factory.mktemp("docs-cache") / "c"
    build(cache_config(teacher_dir, documents_file, out))
    return TopKCache(str(out))
