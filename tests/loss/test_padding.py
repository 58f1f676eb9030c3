"""Rows of variable K: an entry with teacher log-prob -inf is padding (any id: a duplicate of a real id, out of
range), carrying no mass and no gradient, in every impl, divergence, tail mode and temperature, Triton included.
Against the float64 oracle run row by row on each row's real entries only; a row with one entry; an all-padding
row under a mask; all-padding counted rows refused."""

import pytest
import torch

import topkd
from tests.loss.oracle import make_problem, oracle
from tests.loss.test_agreement import CASES, assert_all_close, run, topkd_fn

K_REAL = [7, 1, 3, 7, 2, 5, 4, 6, 1, 7]  # real entries per row, repeating; the rest is padding


@pytest.fixture(scope="module")
def padded():
    return padded_problem()


def padded_problem() -> dict:
    """Rows of K_REAL real entries, padding ids repeating a real one or out of range, a masked all-padding row."""
    pb = make_problem(n=37, vocab=101, k=7, seed=3)
    real = torch.tensor([K_REAL[i % len(K_REAL)] for i in range(37)])
    padding = torch.arange(7)[None] >= real[:, None]
    g = torch.Generator().manual_seed(1)
    junk = torch.randint(0, 101, (37, 7), generator=g)
    junk[::4, -1] = pb["ids"][::4, 0]  # a padding id that repeats a real one
    junk[1, -1] = 5000  # and one out of range: padding ids are never read
    ids = torch.where(padding, junk, pb["ids"])
    logprobs = pb["logprobs"].masked_fill(padding, float("-inf"))
    mask = pb["mask"].clone()
    logprobs[2], mask[2] = float("-inf"), False  # a row of all padding, masked out
    return {**pb, "ids": ids, "logprobs": logprobs, "mask": mask, "real": real}


def row_by_row_oracle(
    x,
    w,
    b,
    *,
    ids,
    logprobs,
    real,
    mask,
    labels,
    teacher_logz=None,
    ce_weight=0.0,
    reduction="sum",
    **kw,
):
    """The float64 oracle on each counted row's real entries alone (its own K), summed."""
    total = x.new_zeros(())
    for i in range(x.shape[0]):
        if not mask[i]:
            continue
        k = int(real[i])
        logz = None if teacher_logz is None else teacher_logz[i : i + 1]
        total = total + oracle(
            x[i : i + 1],
            w,
            b,
            ids[i : i + 1, :k],
            logprobs[i : i + 1, :k],
            teacher_logz=logz,
            labels=labels[i : i + 1],
            ce_weight=ce_weight,
            reduction="sum",
            **kw,
        )
    return total


def _impls():
    from topkd.loss import triton_chunk

    problem = triton_chunk.available()
    return [
        "fused",
        "chunked",
        "dense",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(problem is not None, reason=f"impl='triton': {problem}"),
        ),
    ]


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("divergence,tail", CASES)
def test_padding_carries_no_mass_and_no_gradient(padded, divergence, tail, temperature, impl):
    ce = 0.3 if impl != "triton" or temperature == 1.0 else 0.0  # Triton: no CE at T != 1 (refused)
    kw = dict(
        divergence=divergence,
        tail=tail,
        temperature=temperature,
        labels=padded["labels"],
        ce_weight=ce,
        teacher_logz=padded["logz"][temperature] if tail == "bucket" else None,
    )
    pb = (
        padded
        if impl != "triton"
        else {**padded, **{k: padded[k].float() for k in ("x", "w", "b")}}
    )

    def ours(x, w, b, **rest):
        return topkd_fn(impl)(
            x, w, b, ids=padded["ids"], logprobs=padded["logprobs"], mask=padded["mask"], **rest
        )

    def want(x, w, b, **rest):
        return row_by_row_oracle(
            x.double(),
            w.double(),
            b.double(),
            ids=padded["ids"],
            logprobs=padded["logprobs"],
            real=padded["real"],
            mask=padded["mask"],
            **rest,
        )

    got = run(ours, pb, "sum", **kw)
    expected = run(want, pb, "sum", **kw)
    tol = dict(atol=1e-10, rtol=1e-8) if impl != "triton" else dict(atol=2e-4, rtol=2e-4)
    assert_all_close(
        got, [t if t is None or g is None else t.to(g.dtype) for g, t in zip(got, expected)], **tol
    )


def test_counted_rows_of_padding_only_are_refused(padded):
    with pytest.raises(ValueError, match="expected at least one real entry .* got 1 token"):
        # row 2, unmasked
        topkd.fused_linear_kd(padded["x"], padded["w"], padded["ids"], padded["logprobs"])
    with pytest.raises(ValueError, match="expected values in"):
        # a real entry out of range still is
        topkd.fused_linear_kd(
            padded["x"],
            padded["w"],
            padded["ids"].masked_fill(~torch.isinf(padded["logprobs"]), 5000),
            padded["logprobs"],
            mask=padded["mask"],
        )
