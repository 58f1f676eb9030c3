"""LossOptions: the loss's options validated once, and every rule about them answered in one place."""

import pytest

import topkd
from topkd.loss import LossOptions
from topkd.train import TrainConfig
from topkd.train.config import check_config, loss_options


@pytest.mark.parametrize(
    "kw,needs_logz,labels,untempered",
    [
        ({}, False, False, False),
        ({"temperature": 2.0}, True, False, False),
        ({"temperature": 2.0, "tail": "renorm"}, False, False, False),
        ({"ce_weight": 0.5}, False, True, False),
        ({"ce_weight": 0.5, "temperature": 2.0}, True, True, True),
    ],
)
def test_rules(kw, needs_logz, labels, untempered):
    o = LossOptions(**kw)
    assert (o.needs_logz, o.needs_labels, o.untempered_softmax) == (needs_logz, labels, untempered)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"divergence": "kl2"}, "divergence: expected one of"),
        ({"divergence": "reverse_kl", "tail": "renorm"}, "needs the teacher tail bucket"),
        ({"temperature": 0}, "temperature: expected a finite number > 0"),
        ({"chunk_size": 0}, "chunk_size: expected None"),
    ],
)
def test_bad_options_are_refused_at_construction_by_every_entry_point(kw, match):
    with pytest.raises(ValueError, match=match):
        LossOptions(**kw)
    with pytest.raises(ValueError, match=match):
        topkd.KDLoss(**kw)
    train_kw = {k: v for k, v in kw.items() if k != "chunk_size"}
    if train_kw:
        with pytest.raises(ValueError, match=match):
            check_config(
                TrainConfig(cache="x", out="y", init_from_teacher=True, layers=1, **train_kw)
            )


def test_inputs_are_checked_against_what_the_options_need():
    with pytest.raises(ValueError, match="needs teacher_logz"):
        LossOptions(temperature=2.0).check_inputs(has_logz=False, has_labels=False)
    with pytest.raises(ValueError, match="ce_weight=0.5 needs labels"):
        LossOptions(ce_weight=0.5).check_inputs(has_logz=False, has_labels=False)
    LossOptions(temperature=2.0, tail="renorm").check_inputs(has_logz=False, has_labels=False)


def test_train_builds_the_same_options_from_its_flags():
    cfg = TrainConfig(
        cache="x",
        out="y",
        divergence="jsd",
        beta=0.3,
        temperature=2.0,
        ce_weight=0.1,
        impl="chunked",
    )
    assert loss_options(cfg) == LossOptions("jsd", "bucket", 2.0, 0.3, 0.1, "sum", "chunked")
