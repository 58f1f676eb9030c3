"""topkd.loss.cross: the cross-tokenizer loss (exact bucket KL + sorted-L1 ULD with chain-rule groups) against a
float64 brute force written here from the definition, on odd shapes, K = 1 and K = V, in one chunk or many."""

import pytest
import torch

from topkd.loss.cross import CrossTargets, cross_tokenizer_kd


def _targets(n, v, k, seed, exact=3, uld=3, chain=True):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=g)
    ex_rows, uld_rows = rows[:exact], rows[exact : exact + uld]
    ids = torch.stack(
        [torch.randperm(v, generator=g)[:k] for _ in range(exact)] or [torch.zeros(0, k)]
    )
    ids = ids.long().reshape(exact, k)
    lp = torch.log_softmax(torch.randn(exact, v, generator=g) * 2, 1).gather(1, ids).float()
    lp, order = lp.sort(1, descending=True)
    ids = ids.gather(1, order)
    if exact and k > 1:
        lp[0, -1] = -float("inf")  # a padding entry
    t = torch.softmax(torch.randn(uld, v, generator=g) * 2, 1).sort(1, descending=True).values
    width = torch.randint(1, k + 1, (uld,), generator=g)
    teacher = torch.where(torch.arange(k)[None] < width[:, None], t[:, :k], 0.0)
    rest = 1 - teacher.sum(1)
    groups = (
        torch.arange(uld).repeat_interleave(2)
        if chain and uld
        else torch.zeros(0, dtype=torch.long)
    )
    return CrossTargets(
        exact_rows=ex_rows,
        exact_ids=ids,
        exact_logprobs=lp,
        uld_rows=uld_rows,
        uld_first=torch.randint(0, v, (uld,), generator=g),
        uld_teacher=teacher,
        uld_width=width,
        uld_rest=rest,
        chain_rows=torch.randint(0, n, (len(groups),), generator=g),
        chain_tokens=torch.randint(0, v, (len(groups),), generator=g),
        chain_group=groups,
        ce_rows=torch.arange(n),
        ce_labels=torch.randint(0, v, (n,), generator=g),
    )


def _oracle(h, w, t: CrossTargets, ce_weight):
    """The loss by its definition in float64, every row and entry in plain loops."""
    logp = torch.log_softmax(h.double() @ w.double().T, 1)
    total = torch.zeros((), dtype=torch.float64)
    for r, ids, lps in zip(t.exact_rows, t.exact_ids, t.exact_logprobs):
        real = torch.isfinite(lps)
        p, q = lps[real].double().exp(), logp[r, ids[real]].exp()
        p_tail, q_tail = 1 - p.sum(), 1 - q.sum()
        total = total + (p * (p.log() - q.log())).sum()
        if p_tail > 1e-6:  # K = V: no tail bucket (0 log 0 = 0; float32 rounding aside)
            total = total + p_tail * (p_tail.log() - q_tail.log())
    for g, r in enumerate(t.uld_rows):
        row = logp[r].clone()
        for cr, tok, cg in zip(t.chain_rows, t.chain_tokens, t.chain_group):
            if cg == g:
                row[t.uld_first[g]] = row[t.uld_first[g]] + logp[cr, tok]
        probs = row.exp()
        w_g = int(t.uld_width[g])
        top = probs.sort(descending=True).values[:w_g]
        rest = probs.sum() - top.sum()
        q = t.uld_teacher[g, :w_g].double()
        total = total + (top - q).abs().sum() + (rest - t.uld_rest[g].double()).abs()
    ce = -sum(logp[r, y] for r, y in zip(t.ce_rows, t.ce_labels))
    return total + ce_weight * ce


@pytest.mark.parametrize(
    "n, v, hdim, k, chunk, ce_weight, shape",
    [
        (7, 13, 5, 4, None, 0.0, "odd"),
        (9, 11, 3, 1, 2, 0.5, "K=1, chunks of 2"),
        (6, 8, 4, 8, 1, 0.0, "K=V, chunks of 1"),
        (12, 17, 6, 5, 5, 1.0, "CE"),
    ],
)
def test_the_loss_and_its_gradients_equal_the_float64_definition(
    n, v, hdim, k, chunk, ce_weight, shape
):
    g = torch.Generator().manual_seed(n * v)
    h = torch.randn(n, hdim, generator=g, requires_grad=True)
    w = torch.randn(v, hdim, generator=g, requires_grad=True)
    t = _targets(n, v, k, seed=v)
    loss, parts = cross_tokenizer_kd(h, w, t, ce_weight=ce_weight, chunk_size=chunk)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _oracle(h64, w64, t, ce_weight)
    loss.backward()
    ref.backward()
    assert torch.allclose(loss.double(), ref, rtol=1e-5, atol=1e-5), shape
    assert torch.allclose(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5), shape
    assert torch.allclose(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5), shape
    assert parts["exact_fraction"] == 0.5


@pytest.mark.parametrize("exact, uld, chain", [(0, 4, True), (4, 0, False), (0, 3, False)])
def test_one_kind_of_row_alone(exact, uld, chain):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(8, 4, generator=g, requires_grad=True)
    w = torch.randn(10, 4, generator=g)
    t = _targets(8, 10, 3, seed=4, exact=exact, uld=uld, chain=chain)
    loss, _ = cross_tokenizer_kd(h, w, t)
    assert torch.allclose(loss.double(), _oracle(h.detach(), w, t, 0.0), rtol=1e-5, atol=1e-6)


def test_no_aligned_row_gives_zero_with_zero_gradients():
    h = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(7, 3, requires_grad=True)
    t = _targets(5, 7, 2, seed=1, exact=0, uld=0, chain=False)
    loss, parts = cross_tokenizer_kd(h, w, t)
    loss.backward()
    assert float(loss) == 0.0 and not h.grad.any() and not w.grad.any()
    assert parts["exact_fraction"] == 0.0


def test_identical_distributions_cost_nothing():
    """A teacher equal to the student: KL 0 on exact rows, ULD 0 (its sorted vector and rest are the student's)."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(4, 3, generator=g), torch.randn(6, 3, generator=g)
    logp = torch.log_softmax(h @ w.T, 1)
    probs = logp.exp().sort(1, descending=True).values
    ids = logp.argsort(1, descending=True)
    t = CrossTargets(
        exact_rows=torch.tensor([0, 1]),
        exact_ids=ids[:2, :3],
        exact_logprobs=logp[:2].gather(1, ids[:2, :3]),
        uld_rows=torch.tensor([2, 3]),
        uld_first=torch.tensor([0, 0]),
        uld_teacher=probs[2:, :3],
        uld_width=torch.tensor([3, 2]),
        uld_rest=torch.stack([1 - probs[2, :3].sum(), 1 - probs[3, :2].sum()]),
        chain_rows=torch.zeros(0, dtype=torch.long),
        chain_tokens=torch.zeros(0, dtype=torch.long),
        chain_group=torch.zeros(0, dtype=torch.long),
        ce_rows=torch.zeros(0, dtype=torch.long),
        ce_labels=torch.zeros(0, dtype=torch.long),
    )
    loss, _ = cross_tokenizer_kd(h, w, t)
    assert abs(float(loss)) < 1e-5


def test_no_tensor_of_all_rows_by_the_vocabulary_exists_forward_or_backward():
    """Every op output is watched: the largest is one chunk's [C, V] block, far below [N, V]."""
    from tests.loss.test_memory import LargestAllocation

    n, v = 240, 257
    g = torch.Generator().manual_seed(9)
    h = torch.randn(n, 8, generator=g, requires_grad=True)
    w = torch.randn(v, 8, generator=g, requires_grad=True)
    t = _targets(n, v, 5, seed=2, exact=80, uld=80)
    watch = LargestAllocation()
    with watch:
        loss, _ = cross_tokenizer_kd(h, w, t, ce_weight=0.5, chunk_size=16)
        loss.backward()
    assert watch.numel <= 16 * v < n * v // 4, watch.shape
