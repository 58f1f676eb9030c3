"""Agreement with a peer on full-support KD: K = V forward KL equals liger-kernel's JSD(beta=0).

Liger takes the teacher as hidden states + a projection; we give topkd the same teacher as
all V ids with their log-probs. Liger averages over tokens and does not multiply by T^2.
"""

import pytest
import torch

import topkd

liger = pytest.importorskip(
    "liger_kernel.chunked_loss", reason="liger-kernel is a dev dependency (make test)"
)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_full_support_kl_matches_liger(temperature):
    g = torch.Generator().manual_seed(12)
    n, h_s, h_t, vocab = 45, 24, 40, 211
    x = torch.randn(n, h_s, generator=g)
    w = torch.randn(vocab, h_s, generator=g) / h_s**0.5
    xt, wt = torch.randn(n, h_t, generator=g), torch.randn(vocab, h_t, generator=g) / h_t**0.5 * 3
    labels = torch.randint(0, vocab, (n,), generator=g)

    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    peer = liger.LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0,
        weight_soft_loss=1.0,
        beta=0.0,
        temperature=temperature,
        compiled=False,
        chunk_size=16,
    )
    want = peer(xa, wa, xt, wt, labels)
    want.backward()

    teacher_logp = torch.log_softmax(xt @ wt.T, -1)  # T = 1, the cache's convention
    ids = torch.arange(vocab).expand(n, vocab)
    logz = torch.logsumexp(teacher_logp / temperature, -1)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = (
        topkd.fused_linear_kd(
            xb, wb, ids, teacher_logp, teacher_logz=logz, temperature=temperature, chunk_size=16
        )
        / temperature**2
    )
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-7, rtol=1e-4)
    torch.testing.assert_close(wb.grad, wa.grad, atol=1e-7, rtol=1e-4)
