"""Vocab-parallel loss, 2 gloo processes with uneven shards (51 + 50 of V=101), against the one-process loss.

Every case runs in the same two processes (one spawn); each writes its loss and gradients, and the
test compares them with topkd.fused_linear_kd on the whole lm_head: loss and dX on both processes,
dW and db as the concatenation of the shards. Float64 with chunk 8 on N=37: odd on purpose.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import topkd
from tests.loss.oracle import make_problem
from tests.loss.test_agreement import assert_all_close, run, topkd_fn
from tests.loss.test_padding import padded_problem
from topkd.loss import VocabParallel

SPLIT = 51
CASES = {  # name: (make_problem overrides, loss options)
    "kl-bucket-masked-mean": ({}, dict(divergence="kl", mask=True)),
    "jsd-renorm-T2-ce-sum": (
        {},
        dict(
            divergence="jsd",
            tail="renorm",
            temperature=2.0,
            ce_weight=0.3,
            mask=True,
            reduction="sum",
        ),
    ),
    "tvd-bucket-T2-logz-none": (
        {},
        dict(divergence="tvd", temperature=2.0, logz=True, reduction="none"),
    ),
    "reverse-kl-k1-ce": (dict(k=1), dict(divergence="reverse_kl", ce_weight=0.5)),
    "kl-k-equals-v": (dict(k=101), dict(divergence="kl", mask=True)),
    "all-masked": ({}, dict(divergence="kl", mask="none")),
    # variable K
    "padded-kl-bucket-ce": (dict(padded=True), dict(divergence="kl", mask=True, ce_weight=0.2)),
    "padded-jsd-renorm-T2": (
        dict(padded=True),
        dict(divergence="jsd", tail="renorm", temperature=2.0, mask=True),
    ),
}


def problem_of(overrides: dict) -> dict:
    """make_problem with these overrides; padded=True: rows of variable K (tests/loss/test_padding.py)."""
    overrides = dict(overrides)
    return padded_problem() if overrides.pop("padded", False) else make_problem(**overrides)


def loss_kwargs(pb: dict, opts: dict) -> dict:
    kw = {k: v for k, v in opts.items() if k not in ("mask", "logz", "reduction")}
    if opts.get("mask") is True:
        kw["mask"] = pb["mask"]
    elif opts.get("mask") == "none":
        kw["mask"] = torch.zeros_like(pb["mask"])
    if opts.get("logz"):
        kw["teacher_logz"] = pb["logz"][opts["temperature"]]
    if opts.get("ce_weight"):
        kw["labels"] = pb["labels"]
    return kw


def worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    start, end = (0, SPLIT) if rank == 0 else (SPLIT, 101)
    results = {}
    for name, (problem, opts) in CASES.items():
        pb = problem_of(problem)
        shard = dict(pb, w=pb["w"][start:end].contiguous(), b=pb["b"][start:end].contiguous())

        def fn(x, w, b, *, ids, logprobs, **kw):
            return topkd.fused_linear_kd(
                x,
                w,
                ids,
                logprobs,
                bias=b,
                vocab_parallel=VocabParallel(start, 101),
                chunk_size=8,
                **kw,
            )

        results[name] = run(
            fn,
            shard,
            opts.get("reduction", "mean"),
            ids=pb["ids"],
            logprobs=pb["logprobs"],
            **loss_kwargs(pb, opts),
        )
    pb = make_problem()
    try:  # rank 1 claims rows that overlap rank 0's: refused on every process, never a hang
        topkd.fused_linear_kd(
            pb["x"],
            pb["w"][start:end],
            pb["ids"],
            pb["logprobs"],
            vocab_parallel=VocabParallel(start - rank, 101),
        )
    except ValueError as e:
        results["tiling_error"] = str(e)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab_parallel")
    mp.spawn(worker, args=(str(out / "init"), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_vocab_parallel_matches_the_single_process_loss(parallel_results, name):
    problem, opts = CASES[name]
    pb = problem_of(problem)
    want = run(
        topkd_fn("fused"),
        pb,
        opts.get("reduction", "mean"),
        ids=pb["ids"],
        logprobs=pb["logprobs"],
        **loss_kwargs(pb, opts),
    )
    for rank in range(2):
        loss, d_hidden, _, _ = parallel_results[rank][name]
        assert_all_close([loss, d_hidden, None, None], [want[0], want[1], None, None])
    d_weight = torch.cat([parallel_results[r][name][2] for r in range(2)])
    d_bias = torch.cat([parallel_results[r][name][3] for r in range(2)])
    assert_all_close([want[0], want[1], d_weight, d_bias], want)
    if name == "all-masked":
        assert float(want[0]) == 0.0 and not d_weight.any()


def test_overlapping_shards_are_refused_on_every_process(parallel_results):
    for rank in range(2):
        assert (
            "expected (start, rows) spans tiling [0, 101) once"
            in parallel_results[rank]["tiling_error"]
        )


def test_without_a_process_group_the_error_says_so():
    pb = make_problem()
    with pytest.raises(ValueError, match="expected an initialised torch.distributed process group"):
        topkd.fused_linear_kd(
            pb["x"], pb["w"], pb["ids"], pb["logprobs"], vocab_parallel=VocabParallel(0, 101)
        )
    with pytest.raises(ValueError, match="vocab_parallel: expected impl='fused'"):
        topkd.fused_linear_kd(
            pb["x"],
            pb["w"],
            pb["ids"],
            pb["logprobs"],
            vocab_parallel=VocabParallel(0, 101),
            impl="chunked",
        )
