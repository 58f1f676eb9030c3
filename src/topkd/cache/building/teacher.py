"""The teacher side of the cache: load an HF causal LM, and turn hidden states into top-K rows.

    teacher = load_teacher("path/to/model_dir")            # or a .gguf file
    rows = teacher.topk_rows(input_ids, k=100, temperatures=(2.0,))
    per_sequence = teacher.sequence_rows(sequences, k=100, temperatures=(), batch_size=8)   # TeacherEngine

Every engine (this one, and vLLM in topkd/cache/building/vllm_engine.py) is a TeacherEngine: sequence_rows for
packed sequences and a fingerprint built by `fingerprint()` here, so the cache build never asks which.

The body runs to the final hidden states; the lm_head then runs over token chunks in fp32
(logsumexp, top-K, exact tail mass, c_T), so [batch, seq, vocab] never exists.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from topkd.base.files import json_sha256
from topkd.base.tiles import row_blocks
from topkd.base.version import __version__
from topkd.cache.format.engine_rows import EngineRows
from topkd.cache.format.sampled import Sampler
from topkd.data.documents import position_ids
from topkd.models import final_hidden, load_causal_lm, logit_chunks

HEAD_CHUNK_BYTES = 64 * 2**20  # fp32 logits of one lm_head chunk
ALIGNMENT = "row t holds p(x_{t+1} | x_<=t)"
ATTENTION = "per document: positions restart at each document start, no attention across documents"


class TeacherEngine(Protocol):
    """What the cache build needs from a teacher, whichever engine runs it."""

    vocab: int
    tokenizer: object

    # on_batch(tokens) as work completes; sampler: --targets sampled (its draws per token instead of the top-k)
    def sequence_rows(
        self,
        sequences: list,
        k: int,
        temperatures: tuple[float, ...],
        batch_size: int,
        on_batch=None,
        sampler: Sampler | None = None,
    ) -> list[EngineRows]: ...
    def fingerprint(self, k: int, temperatures: tuple[float, ...]) -> dict: ...


def fingerprint(
    *,
    source: str,
    weights_sha256: str,
    config_sha256: str,
    tokenizer,
    dtype: str,
    vocab: int,
    k: int,
    temperatures: tuple[float, ...],
    engine: str,
) -> dict:
    """The identity of a teacher's rows, as the cache manifest records it: one builder for every engine."""
    return {
        "teacher": source,
        "weights_sha256": weights_sha256,
        "config_sha256": config_sha256,
        "tokenizer_sha256": tokenizer_hash(tokenizer),
        "dtype": dtype,
        "vocab_size": vocab,
        "k": k,
        "temperatures": list(temperatures),
        "engine": engine,
        "topkd_version": __version__,
        "alignment": ALIGNMENT,
        "attention": ATTENTION,
    }


@dataclass
class Teacher:
    model: torch.nn.Module
    tokenizer: object
    source: str
    dtype: torch.dtype

    @property
    def vocab(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @torch.inference_mode()
    def hidden_states(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Final (normed) hidden states [B, L, H] from the model body: no logits.

        position_ids that restart at document starts make transformers mask attention per document."""
        return final_hidden(self.model, input_ids, position_ids)

    @cached_property
    def head_fp32(self) -> tuple[Tensor, Tensor | None]:
        """The lm_head weight (and bias) in fp32, converted once (a bf16 teacher keeps its body in bf16)."""
        head = self.model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        return head.weight.detach().float(), None if bias is None else bias.detach().float()

    @torch.inference_mode()
    def topk_rows(
        self,
        input_ids: Tensor,
        k: int,
        temperatures: tuple[float, ...] = (),
        position_ids: Tensor | None = None,
        sampler: Sampler | None = None,
    ) -> EngineRows:
        """[B, L] token ids -> the rows of every token (flattened B*L). With a sampler
        (--targets sampled), its rows instead of the top-k (topkd/cache/format/sampled.py)."""
        h = self.hidden_states(input_ids, position_ids)
        weight, bias = self.head_fp32
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        if sampler is not None:
            return sampler.rows(h.reshape(-1, h.shape[-1]), weight, bias, softcap)
        return head_topk(h.reshape(-1, h.shape[-1]), weight, bias, k, temperatures, softcap)

    def sequence_rows(
        self,
        sequences: list,
        k: int,
        temperatures: tuple[float, ...],
        batch_size: int,
        on_batch=None,
        sampler: Sampler | None = None,
    ) -> list[EngineRows]:
        """Top-K rows of each packed sequence (topkd.data.documents.Sequence), batching those of equal length;
        on_batch(tokens) after each forward (the build's progress counts finished work, batch by batch)."""
        out: list[EngineRows | None] = [None] * len(sequences)
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(sequences):
            by_len.setdefault(len(s.tokens), []).append(i)
        for length, idx in by_len.items():
            for b in range(0, len(idx), batch_size):
                batch = idx[b : b + batch_size]
                ids = torch.from_numpy(np.stack([sequences[i].tokens for i in batch])).to(
                    self.model.device
                )
                pos = torch.from_numpy(
                    np.stack([position_ids(length, sequences[i].doc_starts) for i in batch])
                )
                rows = self.topk_rows(ids, k, temperatures, pos.to(ids.device), sampler)
                for i, seq_rows in zip(batch, split_rows(rows, len(batch), length)):
                    out[i] = seq_rows
                if on_batch is not None:
                    on_batch(len(batch) * length)
        return out

    def fingerprint(self, k: int, temperatures: tuple[float, ...]) -> dict:
        import transformers

        return fingerprint(
            source=self.source,
            weights_sha256=weights_hash(self.model),
            config_sha256=config_hash(self.model.config),
            tokenizer=self.tokenizer,
            dtype=str(self.dtype).removeprefix("torch."),
            vocab=self.vocab,
            k=k,
            temperatures=temperatures,
            engine=f"transformers {transformers.__version__}",
        )


def head_topk(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    k: int,
    temperatures=(),
    softcap: float | None = None,
    chunk_bytes: int = HEAD_CHUNK_BYTES,
) -> EngineRows:
    """Top-K log-probs of softmax(hidden @ weight.T + bias) over the full vocabulary, token chunks, fp32.

    weight [V, H] and bias [V] are fp32 (Teacher.head_fp32); hidden may be any float dtype."""
    vocab = weight.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"k: expected 1 <= k <= vocab size {vocab}, got {k}")
    scratch, parts = None, []
    for _, z in logit_chunks(hidden, weight, bias, softcap, chunk_bytes):
        if scratch is None:  # one row block (L2-sized on a CPU), reused by every chunk
            scratch = torch.empty(row_blocks(z)[0][1], vocab, device=z.device)
        parts.append(_chunk_topk(z, scratch, k, temperatures))
    return EngineRows.concat(parts)


def _chunk_topk(z: Tensor, scratch: Tensor, k: int, temperatures) -> EngineRows:
    """One chunk of logits (overwritten) -> top-K rows; passes walk L2-sized row blocks."""
    n = z.shape[0]
    values, ids = z.topk(k, dim=1)  # whole chunk at once: topk parallelises over rows
    log_total, log_tail = torch.empty(n), torch.empty(n)
    log_sums = torch.empty(len(temperatures), n)
    for a, b in row_blocks(z):
        zb, eb = z[a:b], scratch[: b - a]
        m = zb.amax(dim=1, keepdim=True)
        zb.sub_(m)  # shifted: max 0, so exp never overflows
        values[a:b] -= m
        # c_T = log sum exp(z/T) - lse(z)/T, on the shifted logits
        for i, t in enumerate(temperatures):
            log_sums[i, a:b] = torch.mul(zb, 1.0 / t, out=eb).exp_().sum(dim=1).log_()
        torch.exp(zb, out=eb)
        log_total[a:b] = eb.sum(dim=1).log_()
        # summed directly: exact when tiny
        log_tail[a:b] = eb.scatter_(1, ids[a:b], 0.0).sum(dim=1).log_()
    logprobs = values - log_total[:, None]
    logz = [log_sums[i] - log_total / t for i, t in enumerate(temperatures)]
    # exact head at T
    log_mass_t = [torch.logsumexp(logprobs / t, dim=1) - c for t, c in zip(temperatures, logz)]
    return EngineRows(
        ids=ids.to(torch.int32).numpy(),
        logprobs=logprobs.numpy(),
        log_mass=torch.logsumexp(logprobs, dim=1).numpy(),
        log_tail=(log_tail - log_total).numpy(),
        logz=_columns(logz, n),
        log_mass_t=_columns(log_mass_t, n),
    )


def _columns(cols: list[Tensor], n: int) -> np.ndarray:
    """Per-temperature [n] columns as one [n, T] array ([n, 0] for none)."""
    return torch.stack(cols, 1).numpy() if cols else np.zeros((n, 0), np.float32)


def split_rows(flat: EngineRows, n_seqs: int, length: int) -> list[EngineRows]:
    """Rows of a [n_seqs, length] batch, flattened by topk_rows, back into one EngineRows per sequence."""
    return [flat.slice(i * length, (i + 1) * length) for i in range(n_seqs)]


def load_teacher(source: str, dtype: str = "float32", device: str = "cpu") -> Teacher:
    """An HF causal LM from a local directory, or a GGUF file (topkd.models.load_causal_lm)."""
    model, tokenizer = load_causal_lm(source, dtype, device, role="teacher")
    return Teacher(
        model=model,
        tokenizer=tokenizer,
        source=os.path.abspath(source),
        dtype=getattr(torch, dtype),
    )


def identity_problem(teacher: Teacher, fingerprint: dict) -> str | None:
    """What differs between a loaded teacher and a cache fingerprint's record of it (None: the same model).
    Cheap comparisons first; the weights' sha256 (about 1 s per GB) last."""
    checks = (
        ("config", lambda: config_hash(teacher.model.config), "config_sha256"),
        ("tokenizer", lambda: tokenizer_hash(teacher.tokenizer), "tokenizer_sha256"),
        ("weights", lambda: weights_hash(teacher.model), "weights_sha256"),
    )
    for what, digest, key in checks:
        got = digest()
        if key in fingerprint and got != fingerprint[key]:
            return f"its {what} sha256 is {got[:12]}, the cache recorded {fingerprint[key][:12]}"
    return None


def weights_hash(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), in state_dict order."""
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def config_hash(config) -> str:
    """sha256 of the model config without where it was loaded from (_name_or_path): content, not spelling."""
    return json_sha256({k: v for k, v in config.to_dict().items() if k != "_name_or_path"})


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id) and the special tokens: equal iff tokenisation ids agree."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return json_sha256({"vocab": vocab, "special": special})
