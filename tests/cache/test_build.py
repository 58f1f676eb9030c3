"""Building a cache: rows equal a direct teacher forward, documents, resume after a real kill, 2 processes."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.cache.tiny import make_text
from tests.conftest import cache_config
from topkd.cache import CacheError, TopKCache, build

# same threads: same bits
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def test_rows_match_a_direct_teacher_forward(built_cache, teacher_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    cache = TopKCache(built_cache)
    for i in (0, 3, len(cache) - 1):  # the last sequence is shorter
        row = cache[i]
        with torch.no_grad():
            logp = torch.log_softmax(model(row["input_ids"][None]).logits[0].double(), -1)
        top = logp.topk(cache.k, dim=-1)
        got = row["teacher_logprobs"].double()
        assert torch.equal(row["teacher_ids"].sort(1).values, top.indices.sort(1).values)
        exact_at_ids = logp.gather(1, row["teacher_ids"])
        # the tail bucket is stored exactly
        decode_kl = (exact_at_ids.exp() * (exact_at_ids - got)).sum(1)
        # companded uint8 steps: coarse only where the mass is tiny
        assert decode_kl.abs().max() < 1e-3
        assert (got[:, 0] - top.values[:, 0]).abs().max() < 0.01  # finest at the top
        assert torch.allclose(row["log_mass"].double().exp(), top.values.exp().sum(1), rtol=1e-5)
        tail = torch.log1p(-top.values.exp().sum(1))
        assert torch.allclose(row["log_tail"].double(), tail, atol=1e-4)
        # c_T; the reader gives it adjusted to the decoded head
        logz2 = torch.logsumexp(logp / 2.0, dim=-1)
        assert (row["logz"][:, 0].double() - logz2).abs().max() < 0.01
        head_t = torch.logsumexp(top.values / 2.0 - logz2[:, None], 1)  # exact tempered top-K mass
        assert torch.allclose(
            torch.logsumexp(got / 2.0 - row["logz"][:, :1].double(), 1), head_t, atol=1e-5
        )
        assert torch.all(got[:, :-1] >= got[:, 1:])  # sorted descending


def test_documents_are_packed_with_recorded_boundaries(teacher_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    texts = [make_text(30, seed=s) for s in range(5)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    build(cache_config(teacher_dir, str(tmp_path / "d.jsonl"), tmp_path / "c", seq_len=64))
    cache = TopKCache(str(tmp_path / "c"))
    stream = np.concatenate(
        [np.append(tok(t, add_special_tokens=False)["input_ids"], tok.eos_token_id) for t in texts]
    )
    starts = np.cumsum(
        [0] + [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts[:-1]]
    )
    got = np.concatenate([cache[i]["input_ids"].numpy() for i in range(len(cache))])
    assert np.array_equal(got, stream)  # nothing dropped, the last sequence is shorter
    flags = np.concatenate([cache[i]["doc_starts"].numpy() + 64 * i for i in range(len(cache))])
    seq_starts = np.arange(0, len(stream), 64)
    assert set(flags) == set(starts) | set(seq_starts)
    assert [cache[i]["token_offset"] for i in range(len(cache))] == list(seq_starts)


def test_teacher_attends_within_documents_only(teacher_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    texts = [make_text(12, seed=1), make_text(12, seed=2)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    build(cache_config(teacher_dir, str(tmp_path / "d.jsonl"), tmp_path / "c", seq_len=200))
    row = TopKCache(str(tmp_path / "c"))[0]
    start = int(row["doc_starts"][1])
    with torch.no_grad():
        alone = torch.log_softmax(model(row["input_ids"][None, start:]).logits[0].double(), -1)
        joint = torch.log_softmax(model(row["input_ids"][None]).logits[0, start:].double(), -1)
    got = row["teacher_logprobs"][start:].double()
    ids = row["teacher_ids"][start:]
    # the second document's rows ignore the first
    assert (got - alone.gather(1, ids)).abs()[:, 0].max() < 0.01
    # and attending across would have differed
    assert (got - joint.gather(1, ids)).abs()[:, 0].max() > 0.05


def _cli(out, teacher_dir, text, *extra):
    return [
        sys.executable,
        "-m",
        "topkd.cli",
        "cache",
        "build",
        "--teacher",
        teacher_dir,
        "--data",
        text,
        "--out",
        str(out),
        "--seq-len",
        "32",
        "--seqs-per-shard",
        "1",
        *extra,
    ]


@pytest.fixture(scope="module")
def long_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "long.txt"
    path.write_text(make_text(4000, seed=11))
    return str(path)


def _shard_digests(root):
    manifest = json.load(open(os.path.join(root, "manifest.json")))
    return [(s["file"], s["sha256"], s["bytes"]) for s in manifest["shards"]]


@pytest.mark.once
@pytest.mark.parametrize(
    "targets",
    [("--targets", "topk", "--k", "8"), ("--targets", "sampled", "--samples", "16")],
    ids=["topk", "sampled"],
)
def test_resume_after_a_real_kill_gives_identical_bytes(teacher_dir, long_text, tmp_path, targets):
    """A sampled build too: each shard draws from its own seeded generator, so the redone shards' draws match."""
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    subprocess.run(
        _cli(ref, teacher_dir, long_text, *targets),
        env=SUBPROCESS_ENV,
        check=True,
        capture_output=True,
    )
    proc = subprocess.Popen(
        _cli(killed, teacher_dir, long_text, *targets),
        env=SUBPROCESS_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        shards = killed / "shards"
        if shards.exists() and len(list(shards.glob("*.json"))) >= 3:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "manifest.json").exists(), (
        "the build finished before the kill: make the data larger"
    )
    with pytest.raises(CacheError, match="missing"):
        TopKCache(str(killed))
    subprocess.run(
        _cli(killed, teacher_dir, long_text, *targets),
        env=SUBPROCESS_ENV,
        check=True,
        capture_output=True,
    )
    assert _shard_digests(killed) == _shard_digests(ref)
    assert not list((killed / "shards").glob("*.tmp-*"))


@pytest.mark.once
def test_two_process_build_equals_one_process(teacher_dir, long_text, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--max-sequences", "9", "--targets", "topk", "--k", "8")
    subprocess.run(
        _cli(one, teacher_dir, long_text, *extra),
        env=SUBPROCESS_ENV,
        check=True,
        capture_output=True,
    )
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29517",
    ]
    res = subprocess.run(
        torchrun + _cli(two, teacher_dir, long_text, *extra)[1:],
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert _shard_digests(two) == _shard_digests(one) and len(_shard_digests(one)) == 9


def test_parts_build_their_own_shards_and_a_last_run_writes_the_manifest(
    teacher_dir, text_file, built_cache, tmp_path, monkeypatch
):
    out = tmp_path / "parts"
    for part in (1, 0):
        assert build(cache_config(teacher_dir, text_file, out, part=part, parts=2)) == {}
        assert not (out / "manifest.json").exists()
    written = {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("*.safetensors")}
    from topkd.cache.building.teacher import Teacher

    monkeypatch.setattr(
        Teacher, "sequence_rows", lambda *a, **k: pytest.fail("a finished shard was recomputed")
    )
    build(cache_config(teacher_dir, text_file, out))
    assert {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("*.safetensors")} == written
    assert _shard_digests(out) == _shard_digests(built_cache)


def test_finished_build_reruns_as_a_no_op_and_refuses_another_build(
    built_cache, teacher_dir, text_file, tmp_path
):
    before = os.path.getmtime(os.path.join(built_cache, "manifest.json"))
    manifest = build(cache_config(teacher_dir, text_file, built_cache))
    assert (
        os.path.getmtime(os.path.join(built_cache, "manifest.json")) == before
        and manifest["totals"]["tokens"]
    )
    with pytest.raises(CacheError, match="different build"):
        build(cache_config(teacher_dir, text_file, built_cache, k=8))


def test_unfinished_cache_of_another_build_is_refused(teacher_dir, text_file, tmp_path):
    build(cache_config(teacher_dir, text_file, tmp_path / "c", max_sequences=2))
    os.remove(tmp_path / "c" / "manifest.json")
    with pytest.raises(CacheError, match="different build"):
        build(cache_config(teacher_dir, text_file, tmp_path / "c", max_sequences=2, seq_len=40))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("k", 0, "k: expected"),
        ("seq_len", 0, "seq_len"),
        ("codec", "zip", "codec"),
        ("temperatures", [0.0], "temperatures"),
        ("dtype", "int8", "dtype"),
        ("data", [], "at least one file"),
        ("data", ["nope.txt"], "existing file"),
        ("engine", "tgi", "engine: expected one of hf | vllm"),
        ("part", 2, "expected 0 <= part < parts=1"),
    ],
)
def test_bad_build_settings_are_refused(teacher_dir, text_file, tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        build(cache_config(teacher_dir, text_file, tmp_path / "c", **{field: value}))


def test_k_larger_than_vocab_is_refused(teacher_dir, text_file, tmp_path):
    with pytest.raises(
        ValueError, match="--k 1001: expected at most the teacher's vocabulary of 1000 ids per row"
    ):
        build(cache_config(teacher_dir, text_file, tmp_path / "c", k=1001))


def test_missing_teacher_is_refused(text_file, tmp_path):
    with pytest.raises(ValueError, match="never fetches from a hub"):
        build(cache_config(str(tmp_path / "no-model"), text_file, tmp_path / "c"))
    assert not (tmp_path / "c").exists()  # a refused start leaves nothing behind


def test_too_many_plain_draws_are_refused_before_the_teacher_loads(
    teacher_dir, text_file, tmp_path, monkeypatch
):
    from topkd.cache.building import engines

    def never(*args, **kwargs):
        raise AssertionError("the teacher was loaded for settings that could never build")

    monkeypatch.setitem(
        engines.ENGINES, "hf", dataclasses.replace(engines.ENGINES["hf"], load=never)
    )
    out = tmp_path / "c"
    with pytest.raises(
        ValueError, match=r"--samples: expected at most 255 draws .* got 256; pass --samples 255"
    ):
        build(
            cache_config(
                teacher_dir, text_file, out, targets="sampled", samples=256, temperatures=[]
            )
        )
    assert not out.exists()  # no .build-*.lock, no empty shards/


@pytest.mark.parametrize(
    "targets,flag,value,readers",
    [
        ("sampled", "top_p", 0.9, "topp"),
        ("sampled", "min_k", 4, "topp"),
        ("sampled", "k", 50, "topk or topp"),
        ("topk", "samples", 50, "sampled"),
        ("topk", "head", 8, "sampled"),
        ("topk", "top_p", 0.9, "topp"),
        ("topp", "samples", 24, "sampled"),
    ],
)
def test_another_kinds_flag_is_refused_not_ignored(
    teacher_dir, text_file, tmp_path, targets, flag, value, readers
):
    typed = "--" + flag.replace("_", "-")
    cfg = cache_config(
        teacher_dir, text_file, tmp_path / "c", targets=targets, temperatures=[], **{flag: value}
    )
    with pytest.raises(
        ValueError,
        match=rf"^{typed}: expected only with --targets {readers}, got {typed} {value} with --targets {targets}, "
        rf"which would ignore it; drop {typed}",
    ):
        build(cfg)
    assert not (tmp_path / "c").exists()


def test_a_hybrid_wider_than_the_vocabulary_names_the_flags_typed(teacher_dir, text_file, tmp_path):
    cfg = cache_config(
        teacher_dir,
        text_file,
        tmp_path / "c",
        targets="sampled",
        head=1000,
        samples=24,
        temperatures=[],
    )
    with pytest.raises(
        ValueError,
        match=r"^--head 1000 \+ --samples 24: expected at most the teacher's vocabulary of 1000 ids",
    ):
        build(cfg)
    assert not (tmp_path / "c" / "shards").exists()
