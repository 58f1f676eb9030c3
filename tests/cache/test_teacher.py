"""The chunked fp32 top-K head against a float64 brute force: odd shapes, K=1, K=V, bias, softcap, temperatures."""

import pytest
import torch

from topkd.cache.building.teacher import head_topk


def brute_force(h, w, b, k, temps, softcap):
    z = h.double() @ w.double().t() + (0 if b is None else b.double())
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    logp = torch.log_softmax(z, -1)
    top = logp.topk(k, -1)
    rest = logp.scatter(1, top.indices, float("-inf"))
    return {
        "ids": top.indices,
        "logprobs": top.values,
        "log_mass": torch.logsumexp(top.values, -1),
        "log_tail": torch.logsumexp(rest, -1),
        "logz": torch.stack([torch.logsumexp(logp / t, -1) for t in temps] or [z[:, :0].sum(1)], 1)[
            :, : len(temps)
        ],
    }


@pytest.mark.parametrize(
    "n,vocab,k,bias,softcap,temps,chunk_rows",
    [
        (37, 101, 7, False, None, (2.0,), 5),  # odd: N, V not multiples of the chunk
        (8, 64, 1, True, None, (0.5, 2.0), 3),  # K = 1
        (9, 50, 50, False, None, (), 4),  # K = V: the tail is empty (-inf)
        (16, 300, 20, True, 30.0, (1.0, 3.0), 1000),  # Gemma-style soft-capping, one chunk
    ],
)
def test_head_topk_matches_float64(n, vocab, k, bias, softcap, temps, chunk_rows):
    g = torch.Generator().manual_seed(n)
    h = torch.randn(n, 16, generator=g)
    w = torch.randn(vocab, 16, generator=g) * 2
    b = torch.randn(vocab, generator=g) if bias else None
    got = head_topk(h, w, b, k, temps, softcap, chunk_bytes=chunk_rows * 4 * vocab)
    ref = brute_force(h, w, b, k, temps, softcap)
    assert torch.equal(torch.from_numpy(got.ids).long().sort(1).values, ref["ids"].sort(1).values)
    assert torch.allclose(torch.from_numpy(got.logprobs).double(), ref["logprobs"], atol=2e-5)
    for name in ("log_mass", "logz"):
        assert torch.allclose(
            torch.from_numpy(getattr(got, name)).double(), ref[name], atol=2e-5
        ), name
    tail = torch.from_numpy(got.log_tail).double()
    if k == vocab:
        assert torch.isneginf(tail).all()
    else:
        assert torch.allclose(tail, ref["log_tail"], atol=2e-5)


def test_tiny_tail_is_exact_not_one_minus_mass():
    h = torch.ones(1, 1)
    # tail mass ~ 3 e^-40: 1 - mass would round to 0
    w = torch.tensor([[40.0], [0.0], [0.0], [0.0]])
    got = head_topk(h, w, None, 1, ())
    assert (
        abs(
            float(got.log_tail[0]) - (torch.log(torch.tensor(3.0, dtype=torch.float64)) - 40).item()
        )
        < 1e-4
    )


def test_k_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="k: expected 1 <= k <= vocab size 4"):
        head_topk(torch.ones(1, 1), torch.ones(4, 1), None, 5, ())
