"""Teacher through vLLM (`topkd cache build --engine vllm`): the same rows, the same shards.

    teacher = VLLMTeacher("path/to/hf_model_dir", k=100, tensor_parallel=8)
    rows = teacher.sequence_rows(sequences)       # one EngineRows per packed sequence, as Teacher.topk_rows gives

vLLM scores prompts, not packed sequences with per-document attention, so every document piece of a
sequence is sent as its own prompt (exactly the context the HF engine gives it: positions restart,
no attention across documents) and the pieces' rows are laid back end to end. For a prompt of L
tokens, vLLM returns prompt_logprobs: None at position 0, then at position t a dict {token id:
Logprob(logprob, rank)} over token t given tokens < t, holding the top-K plus, when the actual token
is outside the top-K, one extra entry with rank > K (dropped here). Our row t is p(x_{t+1} | x_<=t),
so rows 0..L-2 come from prompt_logprobs[1:], and row L-1 (the token after the piece) from the
logprobs of one greedily generated token. Settings that make this exact: max_logprobs >= K (vLLM
refuses more), prefix caching off (a cached prefix has no prompt logprobs), detokenize off.

Differences from the HF engine (both recorded in the fingerprint's "engine"): vLLM gives only the
top-K, so the tail mass is log(1 - top-K mass), not summed directly, and c_T for tempered bucket KD
cannot be computed (--temperatures is refused; renorm KD at any T, and bucket KD at T=1, work).

vLLM is not a pip extra of topkd: every vLLM release pins torch and an older transformers than
topkd's pins (vllm 0.32.0: torch==2.13.0 but transformers<5.20), so it lives in its own environment
(docs/scale-out.md gives the commands). Tested without vLLM on vLLM-shaped outputs
(tests/cache/test_vllm_engine.py).
"""

from __future__ import annotations

import glob
import hashlib
import os

import numpy as np

from topkd.base.files import json_file_sha256
from topkd.cache.building.teacher import fingerprint
from topkd.cache.format.engine_rows import EngineRows, ranked_rows


def rows_from_prompt(
    prompt_ids: list[int], prompt_logprobs: list, next_logprobs: dict, k: int
) -> EngineRows:
    """One prompt's vLLM output -> its rows [L, K], as Teacher.topk_rows gives them."""
    if len(prompt_logprobs) != len(prompt_ids) or (prompt_ids and prompt_logprobs[0] is not None):
        raise ValueError(
            f"vLLM output: expected prompt_logprobs of length {len(prompt_ids)} starting with None, "
            f"got length {len(prompt_logprobs)}; was prompt_logprobs=K set and prefix caching off?"
        )
    entries = list(prompt_logprobs[1:]) + [next_logprobs]
    ranked = []
    for t, entry in enumerate(entries):
        top = [(int(tid), v.logprob) for tid, v in entry.items() if v.rank <= k]
        if len(top) != k:
            raise ValueError(
                f"vLLM output: expected {k} entries ranked 1..{k} at row {t}, got {len(top)} of "
                f"{len(entry)}; set max_logprobs >= K and prompt_logprobs=K"
            )
        ranked.append(top)
    return ranked_rows(ranked, k)


def document_pieces(tokens: np.ndarray, doc_starts: np.ndarray) -> list[np.ndarray]:
    """The sequence cut at its document starts: each piece is one prompt."""
    bounds = sorted({0, *(int(s) for s in doc_starts)}) + [len(tokens)]
    return [tokens[a:e] for a, e in zip(bounds[:-1], bounds[1:]) if e > a]


class VLLMTeacher:
    """A teacher served by vLLM in this process (tensor-parallel over `tensor_parallel` GPUs)."""

    def __init__(
        self,
        source: str,
        k: int,
        dtype: str = "bfloat16",
        tensor_parallel: int = 1,
        max_len: int = 4096,
        gpu_memory_utilization: float = 0.9,
    ):
        if not os.path.isdir(source):
            raise ValueError(
                f"--engine vllm: expected a Hugging Face model directory, got {source!r}"
            )
        try:
            import vllm
        except ImportError as e:
            raise ValueError(
                "--engine vllm: expected vLLM, got no vllm module; vLLM pins its own torch and "
                "transformers, so install it in a separate environment (docs/scale-out.md), or use "
                "--engine hf"
            ) from e
        from transformers import AutoConfig, AutoTokenizer

        self.source, self.k, self.dtype, self.vllm = source, k, dtype, vllm
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        config = AutoConfig.from_pretrained(source)
        self.vocab = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
        self.llm = vllm.LLM(
            model=source,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel,
            max_logprobs=k,
            enable_prefix_caching=False,
            max_model_len=max_len + 1,
            gpu_memory_utilization=gpu_memory_utilization,
            skip_tokenizer_init=True,
        )
        self.params = vllm.SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=k, logprobs=k, detokenize=False
        )

    def sequence_rows(
        self,
        sequences: list,
        k: int | None = None,
        temperatures: tuple[float, ...] = (),
        batch_size: int = 0,
        on_batch=None,
        sampler=None,
    ) -> list[EngineRows]:
        """Rows for packed sequences (topkd.data.documents.Sequence), one vLLM call for all their pieces (vLLM
        batches itself; k was fixed at construction; temperatures are refused by the build)."""
        pieces = [document_pieces(np.asarray(s.tokens), s.doc_starts) for s in sequences]
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for ps in pieces for p in ps]
        outputs = iter(self.llm.generate(prompts, self.params, use_tqdm=False))
        rows = []
        for ps in pieces:
            parts = [_rows_of(next(outputs), self.k) for _ in ps]
            rows.append(EngineRows.concat(parts))
        if on_batch is not None:  # vLLM schedules the whole call itself: one report when it returns
            on_batch(sum(len(s.tokens) for s in sequences))
        return rows

    def fingerprint(self, k: int, temperatures: tuple[float, ...]) -> dict:
        return fingerprint(
            source=self.source,
            weights_sha256=files_hash(self.source),
            config_sha256=json_file_sha256(os.path.join(self.source, "config.json")),
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            vocab=self.vocab,
            k=k,
            temperatures=temperatures,
            engine=f"vllm {self.vllm.__version__}",
        )


def _rows_of(output, k: int) -> dict[str, np.ndarray]:
    return rows_from_prompt(
        list(output.prompt_token_ids),
        list(output.prompt_logprobs),
        output.outputs[0].logprobs[0],
        k,
    )


def files_hash(model_dir: str) -> str:
    """sha256 over the weight files' names, sizes and safetensors headers: a 100B teacher is not re-read."""
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            h.update(f"{os.path.basename(path)}:{os.path.getsize(path)}:".encode() + f.read(size))
    return h.hexdigest()
