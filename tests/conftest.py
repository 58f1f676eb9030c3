"""Shared fixtures: one tiny random teacher, a text file, and a small cache built from them (session-wide)."""
import pytest

from tests.cache.tiny import make_teacher, make_text
from topkd.cache import CacheBuildConfig, build


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory):
    return make_teacher(str(tmp_path_factory.mktemp("teacher")))


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(make_text(1500, seed=7))
    return str(path)


def cache_config(teacher_dir, text_file, out, **kw) -> CacheBuildConfig:
    opts = dict(teacher=teacher_dir, data=[text_file], out=str(out), seq_len=48, k=16, seqs_per_shard=4,
                batch_size=3, temperatures=[2.0])
    opts.update(kw)
    return CacheBuildConfig(**opts)


@pytest.fixture(scope="session")
def built_cache(teacher_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "c"
    build(cache_config(teacher_dir, text_file, out))
    return str(out)
