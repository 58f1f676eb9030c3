"""KL of a model against a teacher cache: the teacher against its own cache is near zero."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from topkd.cache import TopKCache
from topkd.eval import evaluate_vs_cache


def test_teacher_against_its_own_cache_is_near_zero_kl(teacher, built_cache, teacher_dir, tmp_path):
    model, _ = teacher
    own = evaluate_vs_cache(model, TopKCache(built_cache))
    assert own["kl_bucket"] < 1e-3 and own["kl_renorm"] < 1e-3 and own["top1_agreement"] > 0.97
    assert own["student_mass_on_topk"] == pytest.approx(own["teacher_topk_mass"], rel=1e-2)
    other = AutoModelForCausalLM.from_pretrained(teacher_dir)
    torch.manual_seed(0)
    for p in other.parameters():
        p.data.add_(torch.randn_like(p) * 0.5)
    far = evaluate_vs_cache(other.eval(), TopKCache(built_cache))
    assert (
        far["kl_bucket"] > 10 * own["kl_bucket"] and far["top1_agreement"] < own["top1_agreement"]
    )
