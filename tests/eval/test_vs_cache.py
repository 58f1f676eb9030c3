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


def test_padding_of_rows_of_variable_k_is_never_counted():
    """A row of width 3 padded to 6 (-inf entries repeating its first id) scores as the row of width 3."""
    from topkd.eval.vs_cache import _metric_sums

    torch.manual_seed(0)
    hidden, weight = torch.randn(4, 8), torch.randn(20, 8)
    ids = torch.tensor([[3, 7, 1]] * 4)
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 4))
    padded_ids = torch.cat([ids, ids[:, :1].expand(4, 3)], dim=1)
    padded = torch.cat([logprobs, torch.full((4, 3), -torch.inf)], dim=1)
    want = _metric_sums(hidden, weight, None, ids, logprobs)
    got = _metric_sums(hidden, weight, None, padded_ids, padded)
    assert got == pytest.approx(want, rel=1e-6)
