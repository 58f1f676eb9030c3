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
and the bytes are those of the assistant tokens.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from topkd.data.chat import ChatDocument
from topkd.data.documents import iter_documents, pack_sequences, position_ids, whole
from topkd.eval.heads import head_stats
from topkd.models import final_hidden, model_head
from topkd.progress import track


@torch.no_grad()
def evaluate_text(model, tokenizer, paths: list[str], seq_len: int = 1024, max_tokens: int = 0,
                  text_field: str = "text") -> dict:
    documents, text_bytes = _documents(paths, tokenizer, text_field, max_tokens)
    nll, counted, tokens = 0.0, 0, sum(len(whole(d)) for d in documents)
    sequences = list(pack_sequences(documents, seq_len, tokenizer.eos_token_id))
    weight, bias, softcap = model_head(model)
    for seq in track(sequences, desc="eval text", unit="seq"):
        ids = torch.from_numpy(seq.tokens)[None].to(weight.device)
        pos = torch.from_numpy(position_ids(len(seq.tokens), seq.doc_starts))[None].to(weight.device)
        scored = _scored_rows(len(seq.tokens), seq.doc_starts)
        if seq.row_mask is not None:  # chat: only rows whose next token is an assistant target
            scored &= torch.from_numpy(seq.row_mask[:-1])
        hidden = final_hidden(model, ids, pos)[0]
        stats = head_stats(hidden[:-1][scored], weight, bias, targets=ids[0, 1:][scored], softcap=softcap)
        nll -= float(stats["target_logprob"].double().sum())
        counted += int(scored.sum())
    if counted == 0:
        raise ValueError(f"text: expected documents of at least 2 tokens, got nothing to score in {paths}")
    return {"tokens": tokens, "scored_tokens": counted, "bytes": text_bytes, "nll_per_token": nll / counted,
            "perplexity": math.exp(nll / counted), "bits_per_byte": nll / math.log(2) / text_bytes}


def _scored_rows(length: int, doc_starts: np.ndarray) -> torch.Tensor:
    """Row t predicts token t+1: scored unless t+1 starts a document (no context across documents)."""
    starts = np.zeros(length, dtype=bool)
    starts[doc_starts] = True
    return torch.from_numpy(~starts[1:])


def _documents(paths, tokenizer, text_field, max_tokens):
    docs, total, text_bytes = [], 0, 0
    for doc in iter_documents(paths, tokenizer, text_field):
        if isinstance(doc, list):
            raise ValueError("text: expected text documents (.txt or .jsonl), got a 2-D .npy of ready-made "
                             "sequences, whose text bytes are unknown; evaluate the text it came from")
        doc = doc if isinstance(doc, ChatDocument) else whole(doc)
        tokens = whole(doc)
        if max_tokens and total + len(tokens) > max_tokens:
            keep = max_tokens - total
            doc = ChatDocument(doc.tokens[:keep], doc.targets[:keep]) if isinstance(doc, ChatDocument) else doc[:keep]
            tokens = whole(doc)
        docs.append(doc)
        scored_text = tokens[doc.targets] if isinstance(doc, ChatDocument) else tokens
        text_bytes += len(tokenizer.decode(scored_text).encode("utf-8"))
        total += len(tokens)
        if max_tokens and total >= max_tokens:
            break
    return docs, text_bytes
