"""Every impl against the float64 brute-force oracle: divergence x tail x T x reduction x impl.

Odd shapes on purpose: N=37 and V=101 are not multiples of chunk_size=8; 30% of tokens are
masked; a fifth of labels are -100; CE is mixed in. Gradients of hidden, weight and bias.
"""

import pytest
import torch

import topkd
from tests.loss.oracle import make_problem, oracle

CASES = [
    (d, t)
    for d in ("kl", "reverse_kl", "jsd", "tvd")
    for t in ("bucket", "renorm")
    if not (d == "reverse_kl" and t == "renorm")
]


def run(fn, pb, reduction, seed_go=0, **kw):
    x, w = pb["x"].clone().requires_grad_(), pb["w"].clone().requires_grad_()
    b = None if pb["b"] is None else pb["b"].clone().requires_grad_()
    loss = fn(x, w, b, **kw, reduction=reduction)
    if reduction == "none":
        go = torch.rand(
            loss.shape, generator=torch.Generator().manual_seed(seed_go), dtype=loss.dtype
        )
    else:
        go = torch.tensor(1.7, dtype=loss.dtype)  # != 1: exercises the grad_output scaling
    (loss * go).sum().backward()
    return [loss.detach(), x.grad, w.grad, None if b is None else b.grad]


def topkd_fn(impl, chunk=8):
    def fn(x, w, b, *, ids, logprobs, **kw):
        return topkd.fused_linear_kd(x, w, ids, logprobs, bias=b, impl=impl, chunk_size=chunk, **kw)

    return fn


def oracle_fn(x, w, b, *, ids, logprobs, **kw):
    return oracle(x, w, b, ids, logprobs, **kw)


def assert_all_close(got, want, atol=1e-10, rtol=1e-8):
    for name, g, e in zip(("loss", "d_hidden", "d_weight", "d_bias"), got, want):
        if e is None:
            assert g is None
            continue
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def problem():
    return make_problem()


@pytest.mark.parametrize("impl", ["fused", "chunked", "dense"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("divergence,tail", CASES)
def test_matches_float64_oracle(problem, divergence, tail, temperature, reduction, impl):
    kw = dict(
        ids=problem["ids"],
        logprobs=problem["logprobs"],
        mask=problem["mask"],
        divergence=divergence,
        tail=tail,
        temperature=temperature,
        labels=problem["labels"],
        ce_weight=0.3,
        teacher_logz=problem["logz"][temperature] if tail == "bucket" else None,
    )
    assert_all_close(
        run(topkd_fn(impl), problem, reduction, **kw), run(oracle_fn, problem, reduction, **kw)
    )


@pytest.mark.parametrize("impl", ["fused", "chunked", "dense"])
@pytest.mark.parametrize("k", [1, 101])
@pytest.mark.parametrize("divergence", ["kl", "jsd", "tvd", "reverse_kl"])
def test_k_extremes(divergence, k, impl):
    pb = make_problem(k=k, seed=1)
    kw = dict(ids=pb["ids"], logprobs=pb["logprobs"], mask=pb["mask"], divergence=divergence)
    assert_all_close(run(topkd_fn(impl), pb, "mean", **kw), run(oracle_fn, pb, "mean", **kw))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_full_support_kl_is_full_vocabulary_kl(temperature):
    """K = V: bucket KL equals the textbook KL(p_T || q_T) over the whole vocabulary, to rounding."""
    pb = make_problem(k=101, seed=2, bias=False)
    loss = topkd.fused_linear_kd(
        pb["x"],
        pb["w"],
        pb["ids"],
        pb["logprobs"],
        temperature=temperature,
        teacher_logz=pb["logz"][temperature],
        chunk_size=8,
        reduction="none",
    )
    log_p = torch.log_softmax(pb["full"] / temperature, -1)
    log_q = torch.log_softmax(pb["x"] @ pb["w"].T / temperature, -1)
    textbook = (log_p.exp() * (log_p - log_q)).sum(-1) * temperature**2
    torch.testing.assert_close(loss, textbook, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("impl", ["fused", "chunked", "dense"])
def test_batched_hidden_and_no_bias(impl):
    pb = make_problem(n=36, batch=4, bias=False, seed=3)
    for reduction in ("mean", "none"):
        kw = dict(
            ids=pb["ids"],
            logprobs=pb["logprobs"],
            mask=pb["mask"],
            labels=pb["labels"],
            ce_weight=1.0,
        )
        got = run(topkd_fn(impl, chunk=5), pb, reduction, **kw)
        assert got[0].shape == (() if reduction == "mean" else (4, 9))
        assert_all_close(got, run(oracle_fn, pb, reduction, **kw))


def test_chunk_size_does_not_change_the_result(problem):
    kw = dict(
        ids=problem["ids"], logprobs=problem["logprobs"], mask=problem["mask"], divergence="jsd"
    )
    ref = run(topkd_fn("fused", chunk=None), problem, "mean", **kw)
    for chunk in (1, 3, 36, 37, 1000):
        assert_all_close(
            run(topkd_fn("fused", chunk=chunk), problem, "mean", **kw), ref, atol=1e-13
        )


@pytest.mark.slow
@pytest.mark.parametrize("divergence", ["kl", "jsd"])
def test_realistic_vocab_fp32_fused_matches_dense(divergence):
    """A real-sized vocabulary (V = 32,768, H = 256, K = 100) in fp32, default chunk budget."""
    g = torch.Generator().manual_seed(14)
    n, h, vocab, k = 1500, 256, 32768, 100
    x = torch.randn(n, h, generator=g)
    w = torch.randn(vocab, h, generator=g) / h**0.5
    logprobs, ids = torch.log_softmax(torch.randn(n, vocab, generator=g) * 4, -1).topk(k, dim=-1)
    got = []
    for impl in ("fused", "dense"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = topkd.fused_linear_kd(xi, wi, ids, logprobs, impl=impl, divergence=divergence)
        loss.backward()
        got.append((loss.detach(), xi.grad, wi.grad))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("impl", ["fused", "chunked", "dense"])
@pytest.mark.parametrize("temperature,ce", [(1.0, False), (2.0, True), (1.0, True)])
def test_soft_capped_logits_match_the_oracle(impl, temperature, ce):
    """Gemma-2 style final_logit_softcapping (c = 2, so the cap bites on these logits): loss and gradients."""
    pb = make_problem(seed=4)
    kw = dict(
        ids=pb["ids"],
        logprobs=pb["logprobs"],
        mask=pb["mask"],
        softcap=2.0,
        temperature=temperature,
        teacher_logz=pb["logz"][temperature],
        labels=pb["labels"],
        ce_weight=0.5 if ce else 0.0,
    )
    for reduction in ("mean", "none"):
        assert_all_close(
            run(topkd_fn(impl), pb, reduction, **kw), run(oracle_fn, pb, reduction, **kw)
        )


def test_soft_cap_changes_the_loss():
    """Guards the test above: the cap is not a no-op at these shapes."""
    pb = make_problem(seed=4)
    args = (pb["x"], pb["w"], pb["ids"], pb["logprobs"])
    assert (
        abs(float(topkd.fused_linear_kd(*args, softcap=2.0)) - float(topkd.fused_linear_kd(*args)))
        > 1e-2
    )
