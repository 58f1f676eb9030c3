"""Every GPU check and benchmark in one call (benchmarks/gpu.sh): measured beside the cost model's prediction.

    python -m benchmarks.gpu --out runs/gpu            # on the H200 (from the repository root): <= 5 min
    python -m benchmarks.gpu --out runs/gpu --smoke    # the same steps on a CPU at toy sizes (a slow test)

1. check: every KD impl in bf16 (odd N, 10% masked, CE mixed in, every divergence) against the fp32 dense
   loss on the same bf16-rounded inputs (relative L2 of loss, dX, dW; PASS <= 2e-2); the bf16 GEMM rate.
2. loss: projection-only forward+backward at V=201,088, H=2,880, 8K..256K tokens, one process per impl
   (topkd.bench.point --lengths, inputs drawn on the GPU), each point within 120 s or recorded as a timeout,
   a failing impl recorded and the run goes on; the prediction of `topkd bench model` beside each point.
3. train: one training step (topkd.train.loop.train_step, bf16 mixed precision) of random Llama-3.2-1B- and
   3B-shaped students at 8K tokens with fused / chunked / dense: peak memory and model TFLOP/s.
4. targets: issue 14's, judged on the measurements by benchmarks/targets.py.
Files under --out (at most 8 with gpu.sh's log.txt): report.txt, check.json, loss.json, loss.png, train.json,
targets.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import topkd
from benchmarks.targets import judge_gpu
from topkd.bench.common import run_json_lines
from topkd.bench.model import fused_kernels
from topkd.bench.point import teacher_rows

DIVERGENCES = ("kl", "reverse_kl", "jsd", "tvd")
IMPLS = ("fused", "fused:torch", "chunked", "dense")
PEERS = ("liger_jsd", "torch_lce")  # recorded as "unavailable" where not installed
BF16_TOLERANCE = 2e-2
POINT_TIMEOUT_S = 120
FULL = dict(device="cuda", vocab=201088, hidden=2880, lengths=[8192, 32768, 131072, 262144], dense_max=32768,
            check_tokens=4099, gemm_tokens=16384, shapes=["llama-1b", "llama-3b"], train_tokens=8192, layers=0)
SMOKE = dict(device="cpu", vocab=1031, hidden=64, lengths=[257, 1024], dense_max=257, check_tokens=67,
             gemm_tokens=64, shapes=["smollm2"], train_tokens=128, layers=1)


def _loss_and_grads(x0, w0, dtype, rows, impl, divergence):
    x, w = (t.detach().to(dtype, copy=True).requires_grad_() for t in (x0, w0))  # fresh leaves per call
    loss = topkd.fused_linear_kd(x, w, rows["ids"], rows["logprobs"], mask=rows["mask"], labels=rows["labels"],
                                 ce_weight=0.1, divergence=divergence, impl=impl)
    loss.backward()
    return [loss.detach().float(), x.grad.float(), w.grad.float()]


def check_impls(device: str, n: int, vocab: int, hidden: int, k: int = 100) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(n, hidden, generator=g, device=device).to(torch.bfloat16)  # bf16-rounded for both sides
    w0 = (torch.randn(vocab, hidden, generator=g, device=device) / hidden**0.5).to(torch.bfloat16)
    ids, logprobs = teacher_rows(n, vocab, k, device)
    rows = {"ids": ids, "logprobs": logprobs, "mask": torch.rand(n, generator=g, device=device) > 0.1,
            "labels": torch.randint(0, vocab, (n,), generator=g, device=device)}
    out = []
    for divergence in DIVERGENCES:
        want = _loss_and_grads(x0, w0, torch.float32, rows, "dense", divergence)
        for impl in IMPLS:
            try:
                with fused_kernels(impl) as name:
                    got = _loss_and_grads(x0, w0, torch.bfloat16, rows, name, divergence)
            except Exception as e:  # a broken impl is a result; the others still run
                out.append({"impl": impl, "divergence": divergence, "pass": False, "error": str(e)[:300]})
                continue
            errs = {name: float((a - b).norm() / b.norm().clamp_min(1e-30))
                    for name, a, b in zip(("loss", "d_hidden", "d_weight"), got, want)}
            out.append({"impl": impl, "divergence": divergence, **errs,
                        "pass": all(e <= BF16_TOLERANCE for e in errs.values())})
    return out


def gemm_rate(device: str, n: int, vocab: int, hidden: int, dtype=torch.bfloat16) -> dict:
    """FLOP/s of the logits GEMM x [n, H] @ W.T [H, V] in dtype on this device (median of 10 after 3 warm-ups)."""
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
    return {"shape": [n, hidden, vocab], "dtype": str(dtype), "seconds": seconds,
            "tflops": 2 * n * vocab * hidden / seconds / 1e12}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def loss_sweep(s: dict, impls=IMPLS + PEERS) -> list[dict]:
    """One process per impl over its lengths (dense and the peers only up to dense_max), each point within
    POINT_TIMEOUT_S."""
    rows = []
    for impl in impls:
        lengths = [n for n in s["lengths"] if impl in IMPLS[:3] or n <= s["dense_max"]]
        cmd = [sys.executable, "-m", "topkd.bench.point", "--impl", impl, "--lengths", ",".join(map(str, lengths)),
               "--vocab", str(s["vocab"]), "--hidden", str(s["hidden"]), "--dtype", "bfloat16", "--device",
               s["device"], "--repeats", "2"]
        got = run_json_lines(cmd, lengths, POINT_TIMEOUT_S, dict(os.environ))
        rows += [{"impl": impl, "tokens": n, **got[n]} for n in lengths]
        print(f"bench gpu: loss {impl}: " + ", ".join(f"{n}: {got[n]['status']}" for n in lengths), flush=True)
    return rows


def add_predictions(rows: list[dict], s: dict, stored: str) -> None:
    """The cost model's H200 prediction beside each point: from the stored `bench model` run when it has the
    same shapes, else traced now."""
    from topkd.bench import model

    known = {}
    if os.path.exists(stored):
        summary = json.load(open(stored))
        if (summary["config"]["vocab"], summary["config"]["hidden"]) == (s["vocab"], s["hidden"]):
            known = {(p["impl"], p["tokens"]): p for p in summary["points"] if "error" not in p}
    for r in rows:
        p = known.get((r["impl"], r["tokens"]))
        if r["impl"] in PEERS:
            continue  # not modelled
        if p is None:
            p = model.point(r["impl"], r["tokens"], s["vocab"], s["hidden"], 100, torch.bfloat16, model.H200)
        r["predicted_s"], r["predicted_peak_bytes"] = p["predicted_s"], p["peak_bytes"]
        if r.get("status") == "ok":
            r["measured_over_predicted"] = r["time_s"] / r["predicted_s"]


def train_sweep(s: dict) -> list[dict]:
    """One process per student shape; one line per impl (a step's peak memory, time and model TFLOP/s)."""
    rows = []
    for shape in s["shapes"]:
        impls = ["fused", "chunked", "dense"]
        cmd = [sys.executable, "-m", "topkd.bench.train_point", "--phase", "device", "--shape", shape, "--impls",
               ",".join(impls), "--tokens", str(s["train_tokens"]), "--device", s["device"], "--repeats", "2",
               "--layers", str(s["layers"])]
        got = run_json_lines(cmd, impls, 3 * POINT_TIMEOUT_S, dict(os.environ))
        rows += [{"shape": shape, "impl": impl, **got[impl]} for impl in impls]
        print(f"bench gpu: train {shape}: " + ", ".join(f"{i}: {got[i]['status']}" for i in impls), flush=True)
    return rows


def report(device: str, check: dict, loss_rows: list[dict], train_rows: list[dict], targets: list[dict]) -> str:
    lines = [f"device: {device}; torch {torch.__version__}; topkd commit {_commit()}", "", "check (bf16 vs fp32):"]
    for c in check["impls"]:
        errs = c.get("error") or " ".join(f"{k}={c[k]:.2e}" for k in ("loss", "d_hidden", "d_weight"))
        lines.append(f"  {'PASS' if c['pass'] else 'FAIL'} {c['impl']:<12} {c['divergence']:<10} {errs}")
    lines += ["", f"bf16 GEMM: {check['gemm']['tflops']:.0f} TFLOP/s", "",
              f"{'impl':<12} {'tokens':>7} {'status':>8} {'peak GiB':>9} {'pred GiB':>9} {'time s':>8} {'pred s':>8} "
              f"{'meas/pred':>9} {'TFLOP/s':>8}"]
    for r in loss_rows:
        peak = f"{r['peak_bytes'] / 2**30:9.2f}" if r.get("status") == "ok" else f"{'':9}"
        timed = f"{r['time_s']:8.3f}" if r.get("status") == "ok" else f"{'':8}"
        ratio = f"{r['measured_over_predicted']:9.2f}" if "measured_over_predicted" in r else f"{'':9}"
        tflops = f"{r['flops'] / r['time_s'] / 1e12:8.1f}" if r.get("status") == "ok" else ""
        lines.append(f"{r['impl']:<12} {r['tokens']:>7} {r.get('status', '?'):>8} {peak} "
                     f"{r.get('predicted_peak_bytes', 0) / 2**30:9.2f} {timed} {r.get('predicted_s', 0):8.3f} "
                     f"{ratio} {tflops}")
    lines += ["", "training step (bf16 mixed precision, one sample):"]
    for r in train_rows:
        detail = (f"peak {r['peak_bytes'] / 2**30:.1f} GiB, {r['step_s']:.2f} s, {r['tflops']:.0f} TFLOP/s"
                  if r.get("status") == "ok" else r.get("error", ""))
        lines.append(f"  {r['shape']:<10} {r['impl']:<8} {r.get('status', '?'):>7}  {detail}")
    lines += ["", "targets (measured):"]
    lines += [f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}" + (f" at {t['tokens']}" if t["tokens"] else "")
              + (f"  {t['value']:.3f}" if t["value"] is not None else "") for t in targets]
    return "\n".join(lines)


def _commit() -> str:
    from topkd.stamp import stamp

    return stamp("cpu")["commit"]


def plot(rows: list[dict], path: str, title: str) -> None:
    from topkd.bench.common import plot_vs_length

    series, failed = {}, {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        ok = [r for r in rows if r["impl"] == impl and r.get("status") == "ok"]
        series[impl] = ([r["tokens"] for r in ok], [r["peak_bytes"] / 2**30 for r in ok], [r["time_s"] for r in ok])
        failed[impl] = [r["tokens"] for r in rows if r["impl"] == impl and r.get("status") != "ok"]
    plot_vs_length(series, failed, ("peak memory (GiB)", "forward+backward (s)"), title, path)


def run(out: str, smoke: bool) -> dict:
    s = SMOKE if smoke else FULL
    os.makedirs(out, exist_ok=True)
    device = torch.cuda.get_device_name() if s["device"] == "cuda" else "cpu (smoke)"
    check = {"impls": check_impls(s["device"], s["check_tokens"], s["vocab"], s["hidden"]),
             "gemm": gemm_rate(s["device"], s["gemm_tokens"], s["vocab"], s["hidden"]), "device": device}
    _dump(out, "check.json", check)
    loss_rows = loss_sweep(s)
    add_predictions(loss_rows, s, "benchmarks/results/model-h200/model.json")
    _dump(out, "loss.json", {"bench": "gpu", "settings": s, "points": loss_rows})
    plot(loss_rows, os.path.join(out, "loss.png"), f"KD loss on {device}, V={s['vocab']} H={s['hidden']} bf16")
    train_rows = train_sweep(s)
    _dump(out, "train.json", {"settings": s, "points": train_rows})
    targets = judge_gpu({"points": loss_rows}, out)
    _dump(out, "targets.json", targets)
    text = report(device, check, loss_rows, train_rows, targets)
    with open(os.path.join(out, "report.txt"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    return {"check": check, "loss": loss_rows, "train": train_rows, "targets": targets}


def _dump(out: str, name: str, value) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(value, f, indent=1, default=str)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (TRITON_INTERPRET=1 for triton)")
    a = p.parse_args(argv)
    run(a.out, a.smoke)


if __name__ == "__main__":
    main()
