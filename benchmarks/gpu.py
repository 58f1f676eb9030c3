"""Every GPU check and benchmark, stage by stage (benchmarks/gpu.sh runs each stage in its own process).

    python -m benchmarks.gpu STAGE --out runs/gpu            # on the H200, from the repository root
    python -m benchmarks.gpu STAGE --out runs/gpu --smoke    # the same stage on a CPU at toy sizes

Stages, in gpu.sh's order (each reads what the earlier ones wrote, and copes with it missing):
1. check: every KD impl (Triton's included) in bf16 (odd N, 10% masked, CE mixed in, every divergence) against
   the fp32 dense loss on the same bf16-rounded inputs (relative L2 of loss, dX, dW; PASS <= 2e-2).
2. gemm: the bf16 GEMM rate of the logits GEMM (the ceiling the loss is judged against).
3. loss: projection-only forward+backward at V=201,088, H=2,880, 8K..256K tokens, one process per impl
   (topkd.bench.point --lengths), each point within POINT_TIMEOUT_S; peers that cannot run are recorded
   "unavailable" without a process.
4. train: one training step (bf16 mixed precision) of random Llama-3.2-1B- and 3B-shaped students at 8K tokens
   with fused / chunked / dense: peak memory (allocated and reserved) and model TFLOP/s.
5. predict: the cost model's prediction beside each loss point (per point: one that fails is noted, not fatal).
6. report: loss.png, targets.json (benchmarks/targets.py) and report.txt.
Every stage writes its file again after each row it measures (atomically), so a stage killed by its timeout or
a CUDA fault keeps what it measured. Files under --out (7 with gpu.sh's log.txt): check.json, loss.json,
train.json, loss.png, targets.json, report.txt.
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
from topkd import bench
from topkd.bench import (
    Column,
    fused_kernels,
    peer_problem,
    plot_vs_length,
    results_table,
    run_json_lines,
    series_by_impl,
    stamp,
    teacher_rows,
    write_json_atomic,
)

DIVERGENCES = ("kl", "reverse_kl", "jsd", "tvd")
CHECKED = ("fused", "fused:torch", "triton", "chunked", "dense")
PEERS = ("liger_jsd", "torch_lce")  # recorded as "unavailable" where they cannot run
BF16_TOLERANCE = 2e-2
POINT_TIMEOUT_S = 120
# sweep: the impls timed per length. On a GPU "fused" already runs the Triton passes; the smoke run adds
# "triton" so its kernels run (interpreted) before the one call on the device.
FULL = dict(
    device="cuda",
    vocab=201088,
    hidden=2880,
    lengths=[8192, 32768, 131072, 262144],
    dense_max=32768,
    check_tokens=4099,
    gemm_tokens=16384,
    shapes=["llama-1b", "llama-3b"],
    train_tokens=8192,
    train_repeats=2,
    layers=0,
    sweep=["fused", "fused:torch", "chunked", "dense"],
)
SMOKE = dict(
    device="cpu",
    vocab=1031,
    hidden=64,
    lengths=[257, 1024],
    dense_max=257,
    check_tokens=67,
    gemm_tokens=64,
    shapes=["smollm2"],
    train_tokens=128,
    train_repeats=1,  # bf16 steps of a 49k-vocabulary student are seconds each on 2 CPU cores
    layers=1,
    sweep=["fused", "fused:torch", "triton", "chunked", "dense"],
)
MODEL_H200 = "benchmarks/results/model-h200/model.json"


def _loss_and_grads(x0, w0, dtype, rows, impl, divergence):
    # fresh leaves per call
    x, w = (t.detach().to(dtype, copy=True).requires_grad_() for t in (x0, w0))
    loss = topkd.fused_linear_kd(
        x,
        w,
        rows["ids"],
        rows["logprobs"],
        mask=rows["mask"],
        labels=rows["labels"],
        ce_weight=0.1,
        divergence=divergence,
        impl=impl,
    )
    loss.backward()
    return [loss.detach().float(), x.grad.float(), w.grad.float()]


def check_impls(device: str, n: int, vocab: int, hidden: int, k: int = 100):
    """One row per (divergence, impl), yielded as each is measured."""
    g = torch.Generator(device=device).manual_seed(0)
    # bf16-rounded for both sides
    x0 = torch.randn(n, hidden, generator=g, device=device).to(torch.bfloat16)
    w0 = (torch.randn(vocab, hidden, generator=g, device=device) / hidden**0.5).to(torch.bfloat16)
    ids, logprobs = teacher_rows(n, vocab, k, device)
    rows = {
        "ids": ids,
        "logprobs": logprobs,
        "mask": torch.rand(n, generator=g, device=device) > 0.1,
        "labels": torch.randint(0, vocab, (n,), generator=g, device=device),
    }
    for divergence in DIVERGENCES:
        want = _loss_and_grads(x0, w0, torch.float32, rows, "dense", divergence)
        for impl in CHECKED:
            try:
                with fused_kernels(impl) as name:
                    got = _loss_and_grads(x0, w0, torch.bfloat16, rows, name, divergence)
            except Exception as e:  # a broken impl is a result; the others still run
                yield {"impl": impl, "divergence": divergence, "pass": False, "error": str(e)[:300]}
                continue
            errs = {
                name: float((a - b).norm() / b.norm().clamp_min(1e-30))
                for name, a, b in zip(("loss", "d_hidden", "d_weight"), got, want)
            }
            yield {
                "impl": impl,
                "divergence": divergence,
                **errs,
                "pass": all(e <= BF16_TOLERANCE for e in errs.values()),
            }


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
    return {
        "shape": [n, hidden, vocab],
        "dtype": str(dtype),
        "seconds": seconds,
        "tflops": 2 * n * vocab * hidden / seconds / 1e12,
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _device_name(s: dict) -> str:
    return torch.cuda.get_device_name() if s["device"] == "cuda" else "cpu (smoke)"


def stage_check(out: str, s: dict) -> None:
    check = {**_load(out, "check.json", {}), "device": _device_name(s), "impls": []}
    for row in check_impls(s["device"], s["check_tokens"], s["vocab"], s["hidden"]):
        check["impls"].append(row)
        _dump(out, "check.json", check)
        print(
            f"bench gpu: check {row['impl']} {row['divergence']}: {'PASS' if row['pass'] else 'FAIL'}",
            flush=True,
        )


def stage_gemm(out: str, s: dict) -> None:
    check = _load(out, "check.json", {"device": _device_name(s), "impls": []})
    check["gemm"] = gemm_rate(s["device"], s["gemm_tokens"], s["vocab"], s["hidden"])
    _dump(out, "check.json", check)
    print(f"bench gpu: bf16 GEMM {check['gemm']['tflops']:.1f} TFLOP/s", flush=True)


def stage_loss(out: str, s: dict) -> None:
    """One process per impl over its lengths (dense and the peers only up to dense_max)."""
    doc, rows = {"bench": "gpu", "settings": s}, []
    for impl in s["sweep"] + list(PEERS):
        lengths = [n for n in s["lengths"] if impl not in ("dense",) + PEERS or n <= s["dense_max"]]
        problem = peer_problem(impl)
        if problem:  # no process for what cannot import
            got = {n: {"status": "unavailable", "error": problem} for n in lengths}
        else:
            cmd = [
                sys.executable,
                "-m",
                "topkd.bench.point",
                "--impl",
                impl,
                "--lengths",
                ",".join(map(str, lengths)),
                "--vocab",
                str(s["vocab"]),
                "--hidden",
                str(s["hidden"]),
                "--dtype",
                "bfloat16",
                "--device",
                s["device"],
                "--repeats",
                "2",
            ]
            got = run_json_lines(
                cmd,
                lengths,
                POINT_TIMEOUT_S,
                dict(os.environ),
                on_row=_writer(out, "loss.json", doc, rows, {"impl": impl}, "tokens"),
            )
        rows += [{"impl": impl, "tokens": n, **got[n]} for n in lengths]
        _dump(out, "loss.json", {**doc, "points": rows})
        print(
            f"bench gpu: loss {impl}: " + ", ".join(f"{n}: {got[n]['status']}" for n in lengths),
            flush=True,
        )


def stage_train(out: str, s: dict) -> None:
    """One process per student shape; one line per impl (a step's peak memory, time and model TFLOP/s)."""
    doc, rows, impls = {"settings": s}, [], ["fused", "chunked", "dense"]
    for shape in s["shapes"]:
        cmd = [
            sys.executable,
            "-m",
            "topkd.bench.train_point",
            "--phase",
            "device",
            "--shape",
            shape,
            "--impls",
            ",".join(impls),
            "--tokens",
            str(s["train_tokens"]),
            "--device",
            s["device"],
            "--repeats",
            str(s["train_repeats"]),
            "--layers",
            str(s["layers"]),
        ]
        got = run_json_lines(
            cmd,
            impls,
            3 * POINT_TIMEOUT_S,
            dict(os.environ),
            on_row=_writer(out, "train.json", doc, rows, {"shape": shape}, "impl"),
        )
        rows += [{"shape": shape, "impl": impl, **got[impl]} for impl in impls]
        _dump(out, "train.json", {**doc, "points": rows})
        print(
            f"bench gpu: train {shape}: " + ", ".join(f"{i}: {got[i]['status']}" for i in impls),
            flush=True,
        )


def _writer(out: str, name: str, doc: dict, rows: list[dict], fixed: dict, key_name: str):
    """An on_row for run_json_lines: each line of the running process is written as it comes, after `rows`."""
    fresh = []

    def on_row(key, row: dict) -> None:
        fresh.append({**fixed, key_name: key, **row})
        _dump(out, name, {**doc, "points": rows + fresh})

    return on_row


def stage_predict(out: str, s: dict) -> None:
    """The cost model's H200 prediction beside each loss point: from the stored `bench model` run when it has
    the same shapes, else traced now. A point whose prediction fails says why; the others still get theirs."""
    doc = _load(out, "loss.json", None)
    if doc is None:
        raise SystemExit("bench gpu: predict: no loss.json (the loss stage wrote nothing)")
    known = {}
    if os.path.exists(MODEL_H200):
        summary = json.load(open(MODEL_H200))
        if (summary["config"]["vocab"], summary["config"]["hidden"]) == (s["vocab"], s["hidden"]):
            known = {(p["impl"], p["tokens"]): p for p in summary["points"] if "error" not in p}
    for r in doc["points"]:
        if r["impl"] in PEERS:
            continue  # not modelled
        try:
            p = known.get((r["impl"], r["tokens"])) or bench.predict_point(
                r["impl"], r["tokens"], s["vocab"], s["hidden"], 100, torch.bfloat16, bench.H200
            )
            r["predicted_s"], r["predicted_peak_bytes"] = p["predicted_s"], p["peak_bytes"]
        # a model gap is a note on its row, never the loss of the measurements
        except Exception as e:
            r["prediction_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        if r.get("status") == "ok":
            r["measured_over_predicted"] = r["time_s"] / r["predicted_s"]
    _dump(out, "loss.json", doc)
    print(
        f"bench gpu: predicted {sum('predicted_s' in r for r in doc['points'])} points", flush=True
    )


def stage_report(out: str, s: dict) -> None:
    check = _load(out, "check.json", {"device": "?", "impls": []})
    loss_rows = _load(out, "loss.json", {"points": []})["points"]
    train_rows = _load(out, "train.json", {"points": []})["points"]
    if loss_rows:
        plot(
            loss_rows,
            os.path.join(out, "loss.png"),
            f"KD loss on {check['device']}, V={s['vocab']} H={s['hidden']} bf16",
        )
    targets = (
        judge_gpu({"points": loss_rows}, out)
        if os.path.exists(os.path.join(out, "check.json"))
        else []
    )
    _dump(out, "targets.json", targets)
    text = report(check, loss_rows, train_rows, targets)
    with open(os.path.join(out, "report.txt"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)


def _gib(key: str):
    return lambda r: r[key] / 2**30 if key in r else None


def _tflops(r: dict) -> float | None:
    return r["flops"] / r["time_s"] / 1e12 if r.get("status") == "ok" else None


GPU_LOSS_COLUMNS = [
    Column("impl", 12, lambda r: r["impl"]),
    Column("tokens", 7, lambda r: r["tokens"]),
    Column("status", 11, lambda r: r.get("status", "?")),
    Column("peak GiB", 9, _gib("peak_bytes"), ".2f"),
    Column("resv GiB", 9, _gib("peak_reserved_bytes"), ".2f"),
    Column("pred GiB", 9, _gib("predicted_peak_bytes"), ".2f"),
    Column("time s", 8, lambda r: r.get("time_s"), "8.3f"),
    Column("pred s", 8, lambda r: r.get("predicted_s"), "8.3f"),
    Column("meas/pred", 9, lambda r: r.get("measured_over_predicted"), "9.2f"),
    Column("TFLOP/s", 8, _tflops, "8.1f"),
]


def _train_line(r: dict) -> str:
    gib = _gib("peak_bytes")(r)
    reserved = _gib("peak_reserved_bytes")(r)
    detail = (
        f"peak {gib:.2f} GiB (reserved {'-' if reserved is None else f'{reserved:.2f}'}), {r['step_s']:.2f} s, "
        f"{r['tflops']:.0f} TFLOP/s"
        if r.get("status") == "ok"
        else r.get("error", "")
    )
    return f"  {r['shape']:<10} {r['impl']:<8} {r.get('status', '?'):>7}  {detail}"


def report(check: dict, loss_rows: list[dict], train_rows: list[dict], targets: list[dict]) -> str:
    lines = [
        f"device: {check['device']}; torch {torch.__version__}; topkd commit {stamp('cpu')['commit']}",
        "",
        "check (bf16 vs fp32):",
    ]
    for c in check["impls"]:
        errs = c.get("error") or " ".join(
            f"{k}={c[k]:.2e}" for k in ("loss", "d_hidden", "d_weight")
        )
        lines.append(
            f"  {'PASS' if c['pass'] else 'FAIL'} {c['impl']:<12} {c['divergence']:<10} {errs}"
        )
    gemm = check.get("gemm")
    lines += [
        "",
        f"bf16 GEMM: {gemm['tflops']:.0f} TFLOP/s" if gemm else "bf16 GEMM: not measured",
        "",
        results_table(loss_rows, GPU_LOSS_COLUMNS, rule=False, failures_in_short=False),
    ]
    lines += ["", "training step (bf16 mixed precision, one sample):"] + [
        _train_line(r) for r in train_rows
    ]
    lines += ["", "targets (measured):"]
    lines += [
        f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}"
        + (f" at {t['tokens']}" if t["tokens"] else "")
        + (f"  {t['value']:.3f}" if t["value"] is not None else "")
        for t in targets
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    series, failed = series_by_impl(rows, impls, lambda r: r["peak_bytes"] / 2**30, "time_s")
    plot_vs_length(series, failed, ("peak memory (GiB)", "forward+backward (s)"), title, path)


def _load(out: str, name: str, default):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def _dump(out: str, name: str, value) -> None:
    write_json_atomic(os.path.join(out, name), json.loads(json.dumps(value, default=str)))


STAGES = {
    "check": stage_check,
    "gemm": stage_gemm,
    "loss": stage_loss,
    "train": stage_train,
    "predict": stage_predict,
    "report": stage_report,
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "stage", choices=list(STAGES), help="the stage to run (gpu.sh runs them all, in this order)"
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--smoke", action="store_true", help="toy sizes on the CPU (TRITON_INTERPRET=1 for triton)"
    )
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    STAGES[a.stage](a.out, SMOKE if a.smoke else FULL)


if __name__ == "__main__":
    main()
