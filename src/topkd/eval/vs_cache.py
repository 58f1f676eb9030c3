"""How close a model is to the teacher whose top-K cache it is scored against (held-out cache).

    result = evaluate_vs_cache(model, TopKCache("runs/heldout-cache"))
    result["kl_bucket"], result["kl_renorm"], result["top1_agreement"], result["student_mass_on_topk"]

Per counted token (the training stream's mask: no separator rows, no padding), averaged:
  kl_bucket   KL(teacher || model) over K+1 outcomes, the leftover mass being one (the bucket loss)
  kl_renorm   KL over the teacher's top-K ids only, both sides renormalised there
  top1_agreement   the model's argmax is the teacher's most likely token
  teacher_topk_mass  the cache's stored top-K mass (how much of the teacher the cache keeps)
  student_mass_on_topk  the model's probability on the teacher's top-K ids
  acceptance_upper_bound  sum_k min(p_k, q_k) + min(p_tail, q_tail): speculative acceptance as far as a cache
                 can see it; the tail is one bucket, so this is an upper bound of the true sum_v min(p_v, q_v)
                 (`topkd eval --teacher` measures it exactly)
kl_bucket comes from topkd.fused_linear_kd itself (no gradient), the loss the student trains on.
Both are 0 for the teacher itself up to the cache's quantisation (the renorm *training* loss is
not: it compares the renormalised teacher with the student's full softmax).
Rows of variable K (top-p, sampled) are scored over their real entries; their padding is never read. On a sampled
cache the "teacher" is the draws (count / N): kl_bucket is then KL to the draws, whose cross-entropy part is
unbiased, so differences between models scored on one cache are unbiased while the level is not the teacher's
KL (its plug-in entropy is low); top-1 is the most drawn id. `topkd eval --teacher` gives the exact figures.
"""

from __future__ import annotations

import torch

from topkd.base.progress import track
from topkd.cache import TopKCache
from topkd.data.samples import SampleStream
from topkd.eval.heads import head_stats
from topkd.loss import fused_linear_kd
from topkd.loss.fold import fold_beyond
from topkd.models import final_hidden, model_head


def acceptance_bound(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor
) -> torch.Tensor:
    """[N]: sum_k min(p_k, q_k) over the cached ids plus min of the two tails. Each tail token's min(p_v, q_v)
    sums to at most the min of the tail masses, so this bounds the true acceptance from above."""
    p, q = teacher_logprobs.exp(), student_logprobs.exp()
    p_tail, q_tail = (1 - p.sum(-1)).clamp_min(0), (1 - q.sum(-1)).clamp_min(0)
    return torch.minimum(p, q).sum(-1) + torch.minimum(p_tail, q_tail)


@torch.no_grad()
def evaluate_vs_cache(
    model, cache: TopKCache, max_sequences: int = 0, fold_beyond_vocab: bool = False
) -> dict:
    """fold_beyond_vocab: a head smaller than the cache's ids (trained with --fold-beyond-vocab) is scored with those
    ids folded into the tail, as it was trained (topkd/loss/fold.py): its probability on them is 0."""
    stream = SampleStream(cache, cache.seq_len, seed=0)
    weight, bias = _student_head(model, cache.vocab_size)
    n = min(stream.per_epoch, max_sequences) if max_sequences else stream.per_epoch
    sums, counted = dict.fromkeys(METRICS, 0.0), 0
    for i in track(range(n), desc="eval vs cache", unit="seq"):
        sample = {k: v.to(weight.device) for k, v in stream.sample(i).items()}
        mask = sample["kd_mask"]
        if not mask.any():
            continue
        positions = sample["position_ids"][None]
        hidden = final_hidden(model, sample["input_ids"][None], positions)[0][mask]
        ids, logprobs = sample["teacher_ids"][mask], sample["teacher_logprobs"][mask]
        w, b = weight, bias
        if fold_beyond_vocab:
            w, b, ids, logprobs = fold_beyond(weight, bias, ids, logprobs)
        for name, value in _metric_sums(hidden, w, b, ids, logprobs).items():
            sums[name] += value
        counted += int(mask.sum())
    if counted == 0:
        raise ValueError(f"cache {cache.path}: expected counted tokens to score, got none")
    return {"tokens": counted, **{name: total / counted for name, total in sums.items()}}


METRICS = (
    "kl_bucket",
    "kl_renorm",
    "top1_agreement",
    "teacher_topk_mass",
    "student_mass_on_topk",
    "acceptance_upper_bound",
)


def _student_head(model, vocab: int):
    """The student's lm_head over the teacher's vocabulary (padded rows beyond it are not part of its
    distribution); a soft-capped head is refused (the KD loss has no soft-capping of the student)."""
    weight, bias, softcap = model_head(model)
    if softcap:
        raise ValueError(
            "eval against a cache: expected a model without final logit soft-capping (the KD loss "
            "has no soft-capping of the student), got final_logit_softcapping="
            f"{softcap}; evaluate it on text instead"
        )
    return weight[:vocab], None if bias is None else bias[:vocab]


def _metric_sums(hidden, weight, bias, ids, logprobs) -> dict[str, float]:
    """Each of METRICS summed over one sequence's counted tokens."""
    stats = head_stats(hidden, weight, bias, teacher_ids=ids)
    teacher = logprobs.double()
    real = torch.isfinite(
        teacher
    )  # padding of rows of variable K repeats an id: never counted twice
    student = stats["logprobs_at_teacher_ids"].double().masked_fill(~real, -torch.inf)
    p_renorm, q_renorm = teacher.log_softmax(dim=-1), student.log_softmax(dim=-1)
    renorm = torch.where(real, p_renorm.exp() * (p_renorm - q_renorm), 0.0)
    return {
        "kl_bucket": float(
            fused_linear_kd(hidden, weight, ids, logprobs, bias=bias, reduction="sum")
        ),
        "kl_renorm": float(renorm.sum()),
        "top1_agreement": float((stats["argmax"] == ids[:, 0].long()).sum()),
        "teacher_topk_mass": float(teacher.logsumexp(dim=-1).exp().sum()),
        "student_mass_on_topk": float(student.logsumexp(dim=-1).exp().sum()),
        "acceptance_upper_bound": float(acceptance_bound(teacher, student).sum()),
    }
