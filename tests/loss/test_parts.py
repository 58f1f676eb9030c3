"""topkd.loss.loss_parts: the KD and CE terms every impl reduces, summing to the loss; nothing outside a block."""

import pytest
import torch

import topkd
from topkd.loss import loss_parts
from topkd.loss.fused import reduce_per_token


def _inputs(n=13, v=37, h=8, k=5):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    logprobs = torch.log_softmax(torch.randn(n, k, generator=g), -1) - 0.2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[3] = -100
    mask = torch.rand(n, generator=g) > 0.2
    return x, w, ids, logprobs, mask, labels


@pytest.mark.parametrize("impl", ["fused", "chunked", "dense"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_parts_sum_to_the_loss(impl, reduction):
    x, w, ids, logprobs, mask, labels = _inputs()
    with loss_parts() as parts:
        loss = topkd.fused_linear_kd(
            x,
            w,
            ids,
            logprobs,
            mask=mask,
            labels=labels,
            ce_weight=0.3,
            impl=impl,
            reduction=reduction,
        )
    assert float(parts["kd"] + 0.3 * parts["ce"]) == pytest.approx(float(loss), rel=1e-6)
    kd_only = topkd.fused_linear_kd(x, w, ids, logprobs, mask=mask, impl=impl, reduction=reduction)
    assert float(parts["kd"]) == pytest.approx(float(kd_only), rel=1e-6)
    counted = mask & (labels != -100)  # CE is taken where KD counts a token and a label exists
    ce = torch.nn.functional.cross_entropy(x @ w.T, labels.clamp(min=0), reduction="none")[counted]
    assert float(parts["ce"]) == pytest.approx(
        float(ce.sum() if reduction == "sum" else ce.mean()),  # as the loss
        rel=1e-5,
    )


def test_nothing_is_recorded_outside_a_block_and_blocks_add_up():
    x, w, ids, logprobs, mask, _ = _inputs()
    # no block open: nothing to do, no error
    reduce_per_token(torch.ones(3), None, None, None, "none")
    with loss_parts() as parts:
        a = topkd.fused_linear_kd(x, w, ids, logprobs, mask=mask, reduction="sum")
        b = topkd.fused_linear_kd(x[:5], w, ids[:5], logprobs[:5], reduction="sum")
    assert float(parts["kd"]) == pytest.approx(float(a + b), rel=1e-6) and float(parts["ce"]) == 0.0


def test_a_plan_is_made_in_one_place_and_carries_the_whole_call():
    import ast
    import pathlib

    import torch

    from topkd.loss.api import StudentSide, TeacherSide, build_plan
    from topkd.loss.options import LossOptions

    src = pathlib.Path(__file__).parents[2] / "src" / "topkd"
    makers = [
        f"{p.relative_to(src)}:{n.lineno}"
        for p in src.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Plan"
    ]
    assert len(makers) == 1 and makers[0].startswith("loss/api.py"), makers
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    ids = torch.stack([torch.randperm(11)[:4] for _ in range(6)]).reshape(
        2, 3, 4
    )  # distinct per token
    logprobs = torch.log_softmax(torch.randn(2, 3, 4), -1) - 1.0
    mask = torch.tensor([[True, False, True], [True, True, True]])
    x, plan = build_plan(
        StudentSide(hidden, torch.randn(11, 8)),
        TeacherSide(ids, logprobs, mask=mask),
        options=LossOptions(),
    )
    assert x.shape == (6, 8) and plan.row_index.tolist() == [0, 2, 3, 4, 5]
    assert len(plan.rows) == 5 and plan.grad_wanted
    with torch.no_grad():
        assert not build_plan(
            StudentSide(hidden, torch.randn(11, 8)),
            TeacherSide(ids, logprobs),
            options=LossOptions(),
        )[1].grad_wanted
