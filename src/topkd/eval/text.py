"""Held-out perplexity and bits per byte of a causal LM on text files.

    result = evaluate_text(model, tokenizer, ["held_out.txt"], seq_len=1024)
    result["bits_per_byte"], result["perplexity"], result["tokens"]

Documents are tokenised and packed exactly as `topkd cache build` packs them (EOS after each,
cut into seq_len sequences, positions restarting at each document). Every token predicted
from inside its own document counts, including each document's closing EOS; a document's first
token and the first token of each sequence have no context and are not scored. bits per byte =
summed NLL / ln 2 / the UTF-8 bytes of the documents' text (decoded from their tokens), so
models with the same tokenizer compare on exactly the same tokens. Chat JSONL (conversations, see
topkd.data.chat) is scored on its assistant turns only, as the cache counts them: the rest is context,
and the bytes are those of the assistant tokens. Every run also reports the calibration of the model's top-1
(ECE, topkd/eval/tail.py); with a live teacher of the same tokenizer, the full-vocabulary KL(teacher || model),
TVD and speculative acceptance (1 - TVD) per scored token, which a top-K cache cannot give.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from topkd.base.progress import track
from topkd.data.chat import ChatDocument
from topkd.data.documents import iter_documents, pack_sequences, position_ids, whole
from topkd.eval.heads import head_stats, paired_divergences
from topkd.eval.tail import calibration
from topkd.models import final_hidden, model_head


@torch.no_grad()
def evaluate_text(
    model,
    tokenizer,
    paths: list[str],
    seq_len: int = 1024,
    max_tokens: int = 0,
    text_field: str = "text",
    teacher=None,
) -> dict:
    """teacher: a model of the same tokenizer (the student's teacher, live): adds full-vocabulary KL, TVD and
    speculative acceptance per scored token. Calibration (ECE) of the model's own top-1 always."""
    documents, text_bytes = _documents(paths, tokenizer, text_field, max_tokens)
    sequences = list(pack_sequences(documents, seq_len, tokenizer.eos_token_id))
    weight, bias, softcap = model_head(model)
    sums = {"nll": 0.0, "kl": 0.0, "tvd": 0.0}
    confidence, correct, counted = [], [], 0
    for seq in track(sequences, desc="eval text", unit="seq"):
        ids, pos, scored = _sequence_inputs(seq, weight.device)
        hidden = final_hidden(model, ids, pos)[0][:-1][scored]
        targets = ids[0, 1:][scored]
        stats = head_stats(hidden, weight, bias, targets=targets, softcap=softcap)
        sums["nll"] -= float(stats["target_logprob"].double().sum())
        confidence.append(stats["max_logprob"].double().exp().cpu())
        correct.append((stats["argmax"] == targets).cpu())
        if teacher is not None:
            pair = _against_teacher(teacher, ids, pos, scored, hidden, (weight, bias, softcap))
            sums["kl"] += float(pair["kl"].sum())
            sums["tvd"] += float(pair["tvd"].sum())
        counted += int(scored.sum())
    if counted == 0:
        raise ValueError(
            f"text: expected documents of at least 2 tokens, got nothing to score in {paths}"
        )
    result = _text_scores(sums["nll"], counted, text_bytes, sum(len(whole(d)) for d in documents))
    calib = calibration(torch.cat(confidence).numpy(), torch.cat(correct).numpy())
    result.update(ece=calib["ece"], calibration=calib["bins"])
    if teacher is not None:
        result.update(
            kl_full=sums["kl"] / counted,
            tvd=sums["tvd"] / counted,
            acceptance=1 - sums["tvd"] / counted,
        )
    return result


def _sequence_inputs(seq, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed sequence as model inputs (ids, positions restarting per document) and the rows scored: every row
    whose next token is in the same document (chat: and is an assistant target)."""
    ids = torch.from_numpy(seq.tokens)[None].to(device)
    pos = torch.from_numpy(position_ids(len(seq.tokens), seq.doc_starts))[None].to(device)
    scored = _scored_rows(len(seq.tokens), seq.doc_starts)
    if seq.row_mask is not None:
        scored &= torch.from_numpy(seq.row_mask[:-1])
    return ids, pos, scored


def _text_scores(nll: float, counted: int, text_bytes: int, tokens: int) -> dict:
    return {
        "tokens": tokens,
        "scored_tokens": counted,
        "bytes": text_bytes,
        "nll_per_token": nll / counted,
        "perplexity": math.exp(nll / counted),
        "bits_per_byte": nll / math.log(2) / text_bytes,
    }


def _against_teacher(teacher, ids, pos, scored, hidden, student_head) -> dict:
    """The teacher on the same tokens and positions; both heads cut to the teacher's vocabulary (student rows
    beyond it are padding, as in training)."""
    t_weight, t_bias, t_softcap = model_head(teacher)
    vocab = t_weight.shape[0]
    weight, bias, softcap = student_head
    if weight.shape[0] < vocab:
        raise ValueError(
            f"--teacher: expected a student head with at least the teacher's {vocab} rows, got "
            f"{weight.shape[0]}; full-vocabulary KL needs both distributions over one vocabulary"
        )
    t_hidden = final_hidden(teacher, ids.to(t_weight.device), pos.to(t_weight.device))[0][:-1][
        scored
    ]
    student = (weight[:vocab], None if bias is None else bias[:vocab], softcap)
    return paired_divergences(
        hidden, student, t_hidden.to(weight.device), (t_weight, t_bias, t_softcap)
    )


def _scored_rows(length: int, doc_starts: np.ndarray) -> torch.Tensor:
    """Row t predicts token t+1: scored unless t+1 starts a document (no context across documents)."""
    starts = np.zeros(length, dtype=bool)
    starts[doc_starts] = True
    return torch.from_numpy(~starts[1:])


def _documents(paths, tokenizer, text_field, max_tokens):
    docs, total, text_bytes = [], 0, 0
    for doc in iter_documents(paths, tokenizer, text_field):
        if isinstance(doc, list):
            raise ValueError(
                "text: expected text documents (.txt or .jsonl), got a 2-D .npy of ready-made "
                "sequences, whose text bytes are unknown; evaluate the text it came from"
            )
        doc = doc if isinstance(doc, ChatDocument) else whole(doc)
        tokens = whole(doc)
        if max_tokens and total + len(tokens) > max_tokens:
            keep = max_tokens - total
            doc = (
                ChatDocument(doc.tokens[:keep], doc.targets[:keep])
                if isinstance(doc, ChatDocument)
                else doc[:keep]
            )
            tokens = whole(doc)
        docs.append(doc)
        scored_text = tokens[doc.targets] if isinstance(doc, ChatDocument) else tokens
        text_bytes += len(tokenizer.decode(scored_text).encode("utf-8"))
        total += len(tokens)
        if max_tokens and total >= max_tokens:
            break
    return docs, text_bytes
