"""GPU checks for benchmarks/gpu.sh: correctness per impl in bf16, the machine's GEMM rate, and the targets.

    python -m topkd.bench.gpu check --out runs/gpu/check.json             # impls in bf16 vs a float32 reference
    python -m topkd.bench.gpu targets --loss runs/gpu/loss/loss.json --check runs/gpu/check.json

check: every KD impl (fused, triton, chunked, dense) runs forward+backward on the device in bf16 at the paper's
vocabulary and hidden size (odd N, 10% masked, CE mixed in) for every divergence; loss, dX and dW are
compared with the float32 dense loss on the same bf16-rounded inputs (relative L2 error; PASS <= 2e-2,
the bf16 tolerance of tests/loss/test_low_precision.py). Then the bf16 GEMM rate of the projection
itself (x [N, H] @ W.T, median of 10 after 3 warm-ups), the reference for "fused at >= 75% of GEMM".
targets: the issue's targets judged from `topkd bench loss` output and check.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import topkd
from topkd.bench.point import teacher_rows

DIVERGENCES = ("kl", "reverse_kl", "jsd", "tvd")
IMPLS = ("fused", "triton", "chunked", "dense")
BF16_TOLERANCE = 2e-2


def _loss_and_grads(x0, w0, dtype, rows, impl, divergence):
    x, w = (t.detach().to(dtype, copy=True).requires_grad_() for t in (x0, w0))  # fresh leaves per call
    loss = topkd.fused_linear_kd(x, w, rows["ids"], rows["logprobs"], mask=rows["mask"], labels=rows["labels"],
                                 ce_weight=0.1, divergence=divergence, impl=impl)
    loss.backward()
    return [loss.detach().float(), x.grad.float(), w.grad.float()]


def check_impls(device: str, n: int, vocab: int, hidden: int, k: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(n, hidden, generator=g).to(device, torch.bfloat16)  # bf16-rounded: both sides see these
    w0 = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, torch.bfloat16)
    ids, logprobs = teacher_rows(n, vocab, k, device)
    rows = {"ids": ids, "logprobs": logprobs, "mask": (torch.rand(n, generator=g) > 0.1).to(device),
            "labels": torch.randint(0, vocab, (n,), generator=g).to(device)}
    out = []
    for divergence in DIVERGENCES:
        want = _loss_and_grads(x0, w0, torch.float32, rows, "dense", divergence)
        for impl in IMPLS:
            got = _loss_and_grads(x0, w0, torch.bfloat16, rows, impl, divergence)
            errs = {name: float((a - b).norm() / b.norm().clamp_min(1e-30))
                    for name, a, b in zip(("loss", "d_hidden", "d_weight"), got, want)}
            out.append({"impl": impl, "divergence": divergence, **errs,
                        "pass": all(e <= BF16_TOLERANCE for e in errs.values())})
    return out


def gemm_rate(device: str, n: int, vocab: int, hidden: int, dtype=torch.bfloat16) -> dict:
    """FLOP/s of the logits GEMM x [n, H] @ W.T [H, V] in dtype on this device."""
    x = torch.randn(n, hidden, device=device, dtype=dtype)
    w = torch.randn(vocab, hidden, device=device, dtype=dtype)
    out = torch.empty(n, vocab, device=device, dtype=dtype)
    times = []
    for i in range(13):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(x, w.t(), out=out)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"shape": [n, hidden, vocab], "dtype": str(dtype), "seconds": seconds, "tflops": 2 * n * vocab * hidden
            / seconds / 1e12}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def judge(loss_rows: list[dict], check: dict) -> list[dict]:
    """The issue's targets from `topkd bench loss` points (impl, tokens, status, peak_bytes, time_s, flops)."""
    ok = {(r["impl"], r["tokens"]): r for r in loss_rows if r.get("status") == "ok"}
    out = [{"target": "every impl within bf16 tolerance of the fp32 reference",
            "pass": all(c["pass"] for c in check["impls"])}]
    for n, limit in ((32768, 5.0), (262144, 11.0)):
        fused = ok.get(("fused", n))
        gib = None if fused is None else fused["peak_bytes"] / 2**30
        out.append({"target": f"fused peak <= {limit} GiB at {n} tokens", "value": gib,
                    "pass": gib is not None and gib <= limit})
    rate = check["gemm"]["tflops"]
    for (impl, n), r in sorted(ok.items(), key=lambda kv: kv[0][1]):
        if impl != "fused":
            continue
        achieved = r["flops"] / r["time_s"] / 1e12
        out.append({"target": f"fused >= 75% of bf16 GEMM ({rate:.0f} TFLOP/s) at {n}", "value": achieved / rate,
                    "pass": achieved >= 0.75 * rate})
        chunked, kernel = ok.get(("chunked", n)), ok.get(("triton", n))
        if chunked:
            out.append({"target": f"fused faster than chunked at {n}", "value": chunked["time_s"] / r["time_s"],
                        "pass": r["time_s"] < chunked["time_s"]})
        if kernel:  # the Triton path is judged by the same targets; users pick the faster
            out.append({"target": f"triton >= 75% of bf16 GEMM at {n}", "pass": kernel["flops"] / kernel["time_s"]
                        / 1e12 >= 0.75 * rate, "value": kernel["flops"] / kernel["time_s"] / 1e12 / rate})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--device", default="cuda")
    c.add_argument("--tokens", type=int, default=4099)
    c.add_argument("--vocab", type=int, default=201088)
    c.add_argument("--hidden", type=int, default=2880)
    c.add_argument("--k", type=int, default=100)
    c.add_argument("--gemm-tokens", type=int, default=16384)
    c.add_argument("--out", required=True)
    t = sub.add_parser("targets")
    t.add_argument("--loss", required=True, help="loss.json of `topkd bench loss`")
    t.add_argument("--check", required=True, help="check.json of `python -m topkd.bench.gpu check`")
    t.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.cmd == "check":
        result = {"impls": check_impls(a.device, a.tokens, a.vocab, a.hidden, a.k),
                  "gemm": gemm_rate(a.device, a.gemm_tokens, a.vocab, a.hidden),
                  "torch": torch.__version__,
                  "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device}
    else:
        loss = json.load(open(a.loss))
        result = {"targets": judge(loss["points"], json.load(open(a.check)))}
    for row in result.get("impls", []) + result.get("targets", []):
        print(json.dumps(row))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
