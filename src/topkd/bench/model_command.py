"""`topkd bench model`: the cost model's predictions for a device, or its calibration against `bench loss` here.

    topkd bench model --device h200 --vocab 201088 --hidden 2880 --dtype bfloat16    # predictions (meta tensors)
    topkd bench model --calibrate --out benchmarks/results/model-cpu-calibration     # vs `bench loss` here

The model itself is topkd/bench/model.py, the calibration topkd/bench/calibrate.py; this is the command.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from topkd.bench.model import H200, DeviceProfile, predict_point


@dataclass
class ModelBenchConfig:
    lengths: list[int] = field(default_factory=list)
    impls: list[str] = field(default_factory=list)
    vocab: int = 0
    hidden: int = 0
    k: int = 100
    dtype: str = ""
    device: str = "h200"
    gemm_tflops: float = 0.0
    bandwidth_tbs: float = 0.0
    calibrate: bool = False
    out: str = ""


MODEL_BENCH_HELP = {
    "lengths": "token counts (default: 8K..256K; with --calibrate 1K..8K)",
    "impls": "impls to model (default: fused,fused:torch,chunked,dense; fused:torch = fused with its torch "
    "kernels where it would pick Triton; with --calibrate fused,chunked,dense)",
    "vocab": "vocabulary size (default: 201088; with --calibrate 32768, as bench loss on CPU)",
    "hidden": "hidden size (default: 2880; with --calibrate 512)",
    "k": "teacher top-K",
    "dtype": "input dtype (default: bfloat16; with --calibrate float32)",
    "device": "device profile to predict for: h200 (or any name, with --gemm-tflops and --bandwidth-tbs)",
    "gemm_tflops": "another device: its dense bf16 GEMM rate in TFLOP/s (fp32 GEMMs at half); 0: the profile's",
    "bandwidth_tbs": "another device: its memory bandwidth in TB/s; 0: the profile's",
    "calibrate": "measure this CPU's profile and compare the model with `bench loss` here, every impl",
    "out": "output directory (default: benchmarks/results/model-DEVICE or model-cpu-calibration)",
}
PREDICT_DEFAULTS = dict(
    lengths=[8192, 32768, 131072, 262144],
    impls=["fused", "fused:torch", "chunked", "dense"],
    vocab=201088,
    hidden=2880,
    dtype="bfloat16",
)
CALIBRATE_DEFAULTS = dict(
    lengths=[1024, 2048, 4096, 8192],
    impls=["fused", "chunked", "dense"],
    vocab=32768,
    hidden=512,
    dtype="float32",
    out="benchmarks/results/model-cpu-calibration",
)
PROFILES = {"h200": H200}


def with_defaults(cfg: ModelBenchConfig) -> ModelBenchConfig:
    predict_out = f"benchmarks/results/model-{cfg.device}"
    base = CALIBRATE_DEFAULTS if cfg.calibrate else {**PREDICT_DEFAULTS, "out": predict_out}
    values = {k: v for k, v in vars(cfg).items() if v not in ([], 0, "")}
    if (
        not cfg.calibrate
        and cfg.device not in PROFILES
        and not (cfg.gemm_tflops > 0 and cfg.bandwidth_tbs > 0)
    ):
        raise ValueError(
            f"--device: expected one of {sorted(PROFILES)}, got {cfg.device!r}; for another machine "
            "pass its --gemm-tflops and --bandwidth-tbs too (or add a DeviceProfile to PROFILES)"
        )
    return ModelBenchConfig(**{**base, **values})


def profile_for(cfg: ModelBenchConfig) -> DeviceProfile:
    """The named profile, with the rates given on the command line in place of its own (an unnamed device
    starts from the H200's launch cost and cache size)."""
    base = PROFILES.get(cfg.device, H200)
    if not (cfg.gemm_tflops or cfg.bandwidth_tbs):
        return base
    bf16 = cfg.gemm_tflops * 1e12 if cfg.gemm_tflops else base.gemm_flops["bfloat16"]
    return dataclasses.replace(
        base,
        name=cfg.device,
        bandwidth=cfg.bandwidth_tbs * 1e12 or base.bandwidth,
        gemm_flops={
            "bfloat16": bf16,
            "float16": bf16,
            "float32": bf16 / 2,
            "float64": base.gemm_flops["float64"],
        },
        note=f"given on the command line: {bf16 / 1e12:g} TFLOP/s bf16, "
        f"{(cfg.bandwidth_tbs * 1e12 or base.bandwidth) / 1e12:g} TB/s",
    )


def predict_points(cfg: ModelBenchConfig) -> list[dict]:
    """Every (impl, length) traced on meta tensors and priced on the profile; a refused impl is a row."""
    rows = []
    for n in cfg.lengths:
        for impl in cfg.impls:
            try:
                rows.append(
                    predict_point(
                        impl,
                        n,
                        cfg.vocab,
                        cfg.hidden,
                        cfg.k,
                        getattr(torch, cfg.dtype),
                        profile_for(cfg),
                    )
                )
            except (ValueError, ImportError) as e:
                rows.append({"impl": impl, "tokens": n, "error": str(e)[:200]})
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'impl':<12} {'tokens':>7} {'predicted s':>11} {'TFLOP/s':>8} {'/floor':>7} {'peak GiB':>9}  slowest"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:<12} {r['tokens']:>7}  error: {r['error'][:80]}")
            continue
        kind = max(r["by_kind"], key=r["by_kind"].get)
        fit = "" if r["fits"] else " (does not fit)"
        lines.append(
            f"{r['impl']:<12} {r['tokens']:>7} {r['predicted_s']:>11.4f} {r['tflops']:>8.1f} "
            f"{r['over_floor']:>7.2f} {r['peak_bytes'] / 2**30:>9.2f}  {kind}{fit}"
        )
    return "\n".join(lines)


def run_model_bench(cfg: ModelBenchConfig) -> dict:
    """Predict (default) or calibrate; write model.json / calibration.json and a plot under cfg.out."""
    import json
    import os

    from topkd.base.progress import wrote
    from topkd.base.stamp import stamp

    cfg = with_defaults(cfg)
    os.makedirs(cfg.out, exist_ok=True)
    if cfg.calibrate:
        summary = _calibration(cfg)
        name = "calibration"
    else:
        rows = predict_points(cfg)
        print(table(rows))
        summary = {
            "bench": "model",
            "config": vars(cfg),
            "profile": {**vars(profile_for(cfg))},
            "points": rows,
        }
        name = "model"
        _plot_predictions(rows, cfg, os.path.join(cfg.out, "model.png"))
    summary["stamp"] = stamp("cpu")
    with open(os.path.join(cfg.out, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps({"bench": "model", "out": cfg.out, "calibrate": cfg.calibrate}, default=str))
    wrote("bench model", f"{name}.json and {name}.png in {cfg.out}")
    return summary


def _calibration(cfg: ModelBenchConfig) -> dict:
    import os

    from topkd.bench.calibrate import calibrate, calibration_table, plot_calibration
    from topkd.bench.loss import LossBenchConfig, run_point

    # five timed runs per point (median): on 2 shared cores one run of a GiB-sized baseline can be 30% off
    bench = LossBenchConfig(
        vocab=cfg.vocab, hidden=cfg.hidden, k=cfg.k, dtype=cfg.dtype, no_huge_pages=True, repeats=5
    )
    summary = calibrate(
        cfg.lengths,
        cfg.impls,
        cfg.vocab,
        cfg.hidden,
        cfg.k,
        lambda impl, n: run_point(bench, impl, n),
    )
    summary["config"] = vars(cfg)
    print(calibration_table(summary["points"]))
    plot_calibration(summary["points"], os.path.join(cfg.out, "calibration.png"))
    return summary


def _plot_predictions(rows: list[dict], cfg: ModelBenchConfig, path: str) -> None:
    from topkd.bench.common import plot_vs_length

    series = {}
    for impl in cfg.impls:
        ok = [r for r in rows if r["impl"] == impl and "error" not in r]
        series[impl] = (
            [r["tokens"] for r in ok],
            [r["peak_bytes"] / 2**30 for r in ok],
            [r["predicted_s"] for r in ok],
        )
    plot_vs_length(
        series,
        {},
        ("predicted peak memory (GiB)", "predicted forward+backward (s)"),
        f"PREDICTED by the cost model for {cfg.device}: V={cfg.vocab} H={cfg.hidden} {cfg.dtype}",
        path,
    )
