"""Every refusal: the message must name what was expected, what came, and (where one exists) the fix."""

import pytest
import torch

import topkd
from tests.loss.oracle import make_problem

PB = make_problem(n=6, vocab=11, hidden=4, k=3, seed=9, dtype=torch.float32)


def call(**over):
    args = dict(
        hidden=PB["x"],
        weight=PB["w"],
        teacher_ids=PB["ids"],
        teacher_logprobs=PB["logprobs"].float(),
    )
    args.update(over)
    kw = {
        k: args.pop(k)
        for k in list(args)
        if k not in ("hidden", "weight", "teacher_ids", "teacher_logprobs")
    }
    return topkd.fused_linear_kd(
        args["hidden"], args["weight"], args["teacher_ids"], args["teacher_logprobs"], **kw
    )


def ids_with(value):
    ids = PB["ids"].clone()
    ids[2, 1] = value
    return ids


def logprobs_with(value):
    lp = PB["logprobs"].float().clone()
    lp[1, 0] = value
    return lp


REFUSALS = [
    (dict(divergence="kld"), ValueError, "divergence: expected one of"),
    (dict(tail="spread"), ValueError, "tail: expected one of"),
    (dict(impl="cuda"), ValueError, "impl: expected one of"),
    (dict(reduction="avg"), ValueError, "reduction: expected one of"),
    (dict(divergence="reverse_kl", tail="renorm"), ValueError, "use tail='bucket'"),
    (dict(temperature=0.0), ValueError, "temperature: expected a finite number > 0"),
    (dict(divergence="jsd", beta=1.0), ValueError, "beta: expected 0 < beta < 1"),
    (dict(ce_weight=-1.0), ValueError, "ce_weight: expected"),
    (dict(ce_weight=0.5), ValueError, "needs labels"),
    (dict(chunk_size=0), ValueError, "chunk_size: expected"),
    (dict(temperature=2.0), ValueError, "needs teacher_logz"),
    (dict(teacher_ids=ids_with(11)), ValueError, "expected values in [0, 11), got range"),
    (dict(teacher_ids=ids_with(-1)), ValueError, "expected values in [0, 11)"),
    (dict(teacher_ids=PB["ids"].float()), TypeError, "teacher_ids: expected an integer dtype"),
    (dict(teacher_ids=PB["ids"][:5]), ValueError, "teacher_ids: expected shape"),
    (
        dict(teacher_ids=torch.arange(12).repeat(6, 1), teacher_logprobs=torch.full((6, 12), -3.0)),
        ValueError,
        "expected 1 <= K <= V=11, got K=12",
    ),
    (
        dict(teacher_logprobs=PB["logprobs"].float()[:, :2]),
        ValueError,
        "teacher_logprobs: expected shape",
    ),
    (
        dict(teacher_logprobs=logprobs_with(float("nan"))),
        ValueError,
        "expected finite values (or -inf for padding), got 1 NaN/+inf",
    ),
    (dict(teacher_logprobs=logprobs_with(float("inf"))), ValueError, "expected finite values"),
    (dict(teacher_logprobs=logprobs_with(0.5)), ValueError, "expected log-probabilities (<= 0)"),
    (dict(teacher_logprobs=torch.full((6, 3), -0.1)), ValueError, "expected top-K mass <= 1"),
    (
        dict(teacher_logprobs=PB["logprobs"].long()),
        TypeError,
        "teacher_logprobs: expected a floating dtype",
    ),
    (
        dict(teacher_logprobs=PB["logprobs"].float().requires_grad_()),
        ValueError,
        "teacher_logprobs.detach()",
    ),
    (dict(teacher_ids=torch.tensor([[0, 0, 1]] * 6)), ValueError, "expected K distinct ids"),
    (dict(hidden=PB["x"].double()), TypeError, "weight: expected dtype torch.float64 like hidden"),
    (dict(hidden=PB["x"].long()), TypeError, "hidden: expected a floating dtype"),
    (dict(hidden=PB["x"][0]), ValueError, "hidden: expected [N, H] or [B, T, H]"),
    (dict(weight=PB["w"][:, :3]), ValueError, "weight: expected [V, 4]"),
    (dict(mask=torch.ones(6)), TypeError, "mask: expected a bool tensor"),
    (dict(mask=torch.ones(5, dtype=torch.bool)), ValueError, "mask: expected shape (6,)"),
    (
        dict(labels=torch.full((6,), 11), ce_weight=1.0),
        ValueError,
        "labels: expected -100 (ignored) or values",
    ),
    (dict(labels=torch.zeros(6), ce_weight=1.0), TypeError, "labels: expected an integer tensor"),
    (
        dict(teacher_logz=torch.zeros(6, 1), temperature=2.0),
        ValueError,
        "teacher_logz: expected shape (6,)",
    ),
    (dict(teacher_logz=torch.full((6,), -5.0), temperature=2.0), ValueError, "tempered top-K mass"),
    (dict(bias=torch.zeros(10)), ValueError, "bias: expected shape (11,)"),
    (dict(hidden="x"), TypeError, "hidden: expected a torch.Tensor, got str"),
]


@pytest.mark.parametrize("over,exc,fragment", REFUSALS, ids=[r[2][:40] for r in REFUSALS])
def test_refusal(over, exc, fragment):
    with pytest.raises(exc) as info:
        call(**over)
    assert fragment in str(info.value)


def test_bad_values_on_masked_tokens_are_not_refused():
    """Masked rows are padding: anything may sit there."""
    ids, lp = ids_with(999), logprobs_with(float("nan"))
    mask = torch.ones(6, dtype=torch.bool)
    mask[[1, 2]] = False
    assert torch.isfinite(call(teacher_ids=ids, teacher_logprobs=lp, mask=mask))


def test_kdloss_refuses_bad_options_at_construction():
    with pytest.raises(ValueError, match="divergence: expected one of"):
        topkd.KDLoss(divergence="nope")
