"""One training-step measurement, meant to run in a fresh process; prints one JSON line.

    python -m topkd.bench.train_point --phase memory --impls dense --tokens 16384
    python -m topkd.bench.train_point --phase time --impls fused,chunked --tokens 16384 --repeats 2
    python -m topkd.bench.train_point --phase loading --tokens 2048 --batch 4
    python -m topkd.bench.train_point --phase device --device cuda --shape llama-1b --layers 0 --tokens 8192

The student has --shape smollm2 (SmolLM2-135M: H=576, 9 query / 3 KV heads, MLP 1536, V=49,152)
or gemma3-270m (Gemma-3-270M: H=640, 4 query / 1 KV head of 256, MLP 2048, V=262,144, 5 local
layers per global one), tied embeddings, randomly initialised with --layers blocks; every step is
topkd.train.loop.train_step itself (forward, fused/chunked/dense KD loss, backward, clipping,
AdamW). Teacher rows are synthetic top-100 rows. A 64-token step runs first (thread pools,
optimizer state), then:
  memory:  one step; peak RSS of the process, and its rise above the RSS before the step
  time:    --repeats rounds of one step per impl, interleaved so all see the same machine
  device:  on a GPU (benchmarks/gpu.sh), per impl a bf16 mixed-precision step's allocator peak, median time
           and model TFLOP/s (model_flops), one JSON line per impl
  loading: a rice-zstd cache of the same rows is written to a temp dir; after one untimed full-size
           step, rounds of (a step whose batch is decoded from the cache in the training process, a
           step on a batch held in memory), alternating which runs first
An allocation failure is a result ("oom"): the address space is capped with RLIMIT_AS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import tempfile
import time

import numpy as np
import torch

import topkd
from topkd.base.memory import status_kib
from topkd.bench.common import measured, out_of_memory
from topkd.bench.point import PeakMemory, teacher_rows
from topkd.data.samples import SampleStream
from topkd.loss import LossOptions
from topkd.train.config import TrainConfig
from topkd.train.loop import train_step
from topkd.train.run import Run
from topkd.train.student import KDStudent

SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)
GEMMA3_270M = dict(
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    tie_word_embeddings=True,
    final_logit_softcapping=None,
    rms_norm_eps=1e-6,
)
# Llama-3.2-1B
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=16,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
# Llama-3.2-3B
LLAMA_3B = dict(LLAMA_1B, hidden_size=3072, num_attention_heads=24, num_hidden_layers=28)
SHAPES = {
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", SMOLLM2),
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_270M),
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM", LLAMA_1B),
    "llama-3b": ("LlamaConfig", "LlamaForCausalLM", LLAMA_3B),
}
K = 100


class HeldBatch:
    """A stream that always returns the same batch: the in-memory side of the loading comparison."""

    per_epoch = 2**62  # one endless epoch

    def __init__(self, batch: dict):
        self.held = batch

    def batch(self, first_sample: int, size: int) -> dict:
        return self.held


def make_student(
    shape: str,
    layers: int,
    max_len: int,
    impl: str,
    device: str = "cpu",
    head_dtype: torch.dtype = torch.float32,
) -> tuple[KDStudent, torch.optim.Optimizer]:
    """A randomly initialised student of this shape (layers=0: the shape's own depth), built on the device."""
    import transformers

    config_name, model_name, dims = SHAPES[shape]
    torch.manual_seed(0)
    dims = {**dims, "num_hidden_layers": layers or dims.get("num_hidden_layers", 2)}
    config = getattr(transformers, config_name)(max_position_embeddings=max_len, **dims)
    with torch.device(device):
        model = getattr(transformers, model_name)(config)
    model.config.use_cache = False
    module = KDStudent(
        model.train(), dims["vocab_size"], LossOptions(impl=impl), head_dtype=head_dtype
    )
    return module, torch.optim.AdamW(module.parameters(), lr=1e-4)


def model_flops(module: KDStudent, tokens: int) -> float:
    """FLOPs of one training step as MFU counts them: 6 x (parameters a token multiplies: every parameter, less
    an untied input embedding, which is a lookup) x tokens, plus causal attention, 6 x layers x tokens^2 x H."""
    model = module.model
    params = sum(p.numel() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.data_ptr() != head.data_ptr():
        params -= embed.numel()
    return (
        6 * params * tokens
        + 6 * model.config.num_hidden_layers * tokens**2 * model.config.hidden_size
    )


def synthetic_batch(
    vocab: int, rows: int, size: int, seed: int = 0, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """`size` samples of `rows` tokens, one document each, with synthetic teacher top-K rows (drawn on device)."""
    ids, logprobs = teacher_rows(rows * size, vocab, K, device, seed)
    ids, logprobs = ids.cpu(), logprobs.cpu()
    tokens = torch.randint(0, vocab, (size, rows), generator=torch.Generator().manual_seed(seed))
    return {
        "input_ids": tokens,
        "position_ids": torch.arange(rows).expand(size, rows).contiguous(),
        "teacher_ids": ids.view(size, rows, K),
        "teacher_logprobs": logprobs.view(size, rows, K),
        "teacher_logz": torch.zeros(size, rows),
        "kd_mask": torch.ones(size, rows, dtype=torch.bool),
        "labels": torch.full((size, rows), -100),
    }


def step(module, optimizer, stream, size: int, index: int = 0, bf16: bool = False) -> float:
    cfg = TrainConfig(
        batch_size=size, grad_accum=1, steps=10**6, warmup_steps=0, autocast_bf16=bf16
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    run = Run(cfg, module, stream, optimizer, scheduler, state={"step": 0, "samples": index * size})
    return train_step(run)["seconds"]


def warm_up(module, optimizer) -> None:
    step(module, optimizer, HeldBatch(synthetic_batch(module.teacher_vocab, 64, 1, seed=9)), 1)
    topkd.loss.release_workspace()


def measure_memory(shape: str, impl: str, tokens: int, layers: int) -> dict:
    module, optimizer = make_student(shape, layers, tokens, impl)
    warm_up(module, optimizer)
    batch = HeldBatch(synthetic_batch(module.teacher_vocab, tokens, 1))
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    seconds = step(module, optimizer, batch, 1)
    return {
        "impl": impl,
        "step_peak_bytes": memory.peak(),
        "process_peak_bytes": status_kib("VmHWM") * 1024,
        "step_s": seconds,
    }


def measure_time(shape: str, impls: list[str], tokens: int, layers: int, repeats: int) -> dict:
    module, optimizer = make_student(shape, layers, tokens, impls[0])
    warm_up(module, optimizer)
    batch = HeldBatch(synthetic_batch(module.teacher_vocab, tokens, 1))
    times = {impl: [] for impl in impls}
    for _ in range(repeats):
        for impl in impls:
            module.options = dataclasses.replace(module.options, impl=impl)
            times[impl].append(step(module, optimizer, batch, 1))
    return {"times_s": times, "median_s": {impl: statistics.median(t) for impl, t in times.items()}}


def measure_device(
    shape: str, impls: list[str], tokens: int, layers: int, repeats: int, device: str
):
    """Per impl, one JSON line: a bf16 mixed-precision step's peak memory (allocated and reserved), median
    time and model TFLOP/s. An impl that runs out of memory is a line too; the next impl still runs."""
    module, optimizer = make_student(shape, layers, tokens, impls[0], device, torch.bfloat16)
    vocab = module.teacher_vocab
    batch = HeldBatch(
        {k: v.to(device) for k, v in synthetic_batch(vocab, tokens, 1, device=device).items()}
    )
    flops = model_flops(module, tokens)
    for impl in impls:
        module.options = dataclasses.replace(module.options, impl=impl)
        row = {"impl": impl, "tokens": tokens, "flops": flops}
        try:
            step(module, optimizer, batch, 1, bf16=True)  # warm: kernels, optimizer state
            memory = PeakMemory(torch.device(device))
            memory.reset()
            step(module, optimizer, batch, 1, bf16=True)
            times = [step(module, optimizer, batch, 1, bf16=True) for _ in range(repeats)]
            row.update(
                status="ok",
                peak_bytes=memory.peak() + memory.base,
                **memory.reserved(),
                step_s=statistics.median(times),
                tflops=flops / statistics.median(times) / 1e12,
            )
        except torch.OutOfMemoryError as e:
            row.update(out_of_memory(e))
        optimizer.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)


def measure_loading(shape: str, tokens: int, size: int, layers: int, repeats: int) -> dict:
    from topkd.cache import TopKCache

    module, optimizer = make_student(shape, layers, tokens, "fused")
    warm_up(module, optimizer)
    with tempfile.TemporaryDirectory() as root:
        write_synthetic_cache(root, module.teacher_vocab, tokens, size * (repeats + 1))
        stream = SampleStream(TopKCache(root), tokens, seed=0)
        held = HeldBatch(stream.batch(0, size))
        # the first full-size step pays one-time costs: not timed
        step(module, optimizer, held, size)
        cached, in_memory, decode = [], [], []
        for r in range(repeats):
            t0 = time.perf_counter()
            stream.batch((r + 1) * size, size)  # decode alone, on samples not read before
            decode.append(time.perf_counter() - t0)
            stream.forget_decoded()  # nothing left decoded: the cached step reads its batch from the shards
            pair = [
                lambda: cached.append(step(module, optimizer, stream, size, index=r)),
                lambda: in_memory.append(step(module, optimizer, held, size)),
            ]
            for run in pair if r % 2 == 0 else pair[::-1]:  # alternate which goes first
                run()
    return {
        "cached_step_s": cached,
        "in_memory_step_s": in_memory,
        "decode_batch_s": decode,
        "cached_over_in_memory": statistics.median(cached) / statistics.median(in_memory),
    }


def write_synthetic_cache(root: str, vocab: int, rows: int, n_seqs: int) -> None:
    """A real rice-zstd cache (the build's writer) holding synthetic teacher rows."""
    from topkd.cache.format import (
        DEFAULT_CODEC,
        TeacherSequence,
        encode_shard,
        shard_facts,
        write_shard,
    )
    from topkd.cache.format import manifest as mf

    os.makedirs(os.path.join(root, "shards"))
    seqs = []
    for i in range(n_seqs):
        ids, logprobs = teacher_rows(rows, vocab, K, "cpu", seed=100 + i)
        lp = logprobs.numpy()
        mass = np.logaddexp.reduce(lp, axis=1).astype(np.float32)
        seqs.append(
            TeacherSequence(
                input_ids=np.random.default_rng(i).integers(0, vocab, rows),
                ids=ids.numpy(),
                logprobs=lp,
                log_mass=mass,
                log_tail=np.log1p(-np.exp(mass)).astype(np.float32),
                logz=np.zeros((rows, 0), np.float32),
                doc_starts=np.array([0]),
                source_index=i,
                token_offset=i * rows,
            )
        )
    fingerprint = {
        "teacher": "synthetic",
        "vocab_size": vocab,
        "k": K,
        "temperatures": [],
        "tokenizer_sha256": "synthetic",
        "dtype": "float32",
        "engine": "synthetic",
        "alignment": "row t holds p(x_{t+1} | x_<=t)",
    }
    build = {"seq_len": rows, "codec": DEFAULT_CODEC, "separator": None, "data": []}
    build_hash = mf.build_hash(fingerprint, build)
    arrays, meta = encode_shard(
        seqs,
        vocab=vocab,
        codec_name=DEFAULT_CODEC,
        identity={"build_hash": build_hash, "shard": 0, "sequences": f"0,{n_seqs}"},
    )
    nbytes = write_shard(mf.shard_path(root, 0), arrays, meta)
    side = mf.write_sidecar(
        root, 0, nbytes, 0, n_seqs, rows * n_seqs, build_hash, **shard_facts(seqs, meta)
    )
    mf.write_manifest(root, fingerprint, build, [side])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", required=True, choices=["memory", "time", "loading", "device"])
    p.add_argument("--device", default="cpu", help="device phase: cuda (or cpu for a smoke run)")
    p.add_argument("--impls", default="fused", help="comma-separated: fused, chunked, dense")
    p.add_argument("--tokens", type=int, required=True, help="tokens per sample")
    p.add_argument("--batch", type=int, default=1, help="samples per step (loading phase)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mem-limit-gib", type=float, default=0.0, help="address-space cap (0: none)")
    a = p.parse_args(argv)
    if a.mem_limit_gib > 0:
        cap = int(a.mem_limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    impls = a.impls.split(",")
    if a.phase == "device":  # one line per impl, printed as each finishes
        measure_device(a.shape, impls, a.tokens, a.layers, a.repeats, a.device)
        return
    row = {
        "phase": a.phase,
        "shape": a.shape,
        "impls": impls,
        "tokens": a.tokens,
        "layers": a.layers,
        "batch": a.batch,
    }
    phases = {
        "memory": lambda: measure_memory(a.shape, impls[0], a.tokens, a.layers),
        "time": lambda: measure_time(a.shape, impls, a.tokens, a.layers, a.repeats),
        "loading": lambda: measure_loading(a.shape, a.tokens, a.batch, a.layers, a.repeats),
    }
    row.update(measured(phases[a.phase]))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
