"""The cost model: traces count the loss's real work, prices follow the roofline, the CLI writes its outputs."""

import json

import pytest
import torch

from topkd.base.trace import Op
from topkd.bench import model
from topkd.bench.model import DeviceProfile, op_seconds, trace_impl
from topkd.loss.chunk import LossSpec
from topkd.loss.fused import GPU_ROW_MULTIPLE, chunk_rows


@pytest.mark.parametrize("impl", ["fused", "fused:torch", "chunked", "dense"])
def test_meta_traces_count_six_nvh_of_gemm(impl):
    n, v, h = 1000, 4096, 64
    ops, peak = trace_impl(impl, n, v, h, 8, torch.bfloat16)
    assert sum(op.flops for op in ops) == 6 * n * v * h
    assert peak >= (2 * n * h + 2 * v * h) * 2  # inputs and their gradients at least


def test_fused_peak_is_tokens_times_hidden_not_tokens_times_vocab():
    """On meta the GPU regime: 1 GiB of chunk buffers (21,760 rows at V=8192), then only [N, H] and [N, K] grow."""
    small = trace_impl("fused", 32768, 8192, 64, 8, torch.bfloat16)[1]
    large = trace_impl("fused", 131072, 8192, 64, 8, torch.bfloat16)[1]
    chunked = trace_impl("chunked", 131072, 8192, 64, 8, torch.bfloat16)[1]
    # dX, X, teacher rows, per-token scalars
    assert large - small < 98304 * (2 * 64 * 2 + 8 * 8 + 64)
    assert chunked - large > 131072 * 8192 * 2 // 2  # the baseline holds its [N, V] logits


def test_roofline_prices():
    p = DeviceProfile("toy", {"bfloat16": 1e12}, bandwidth=1e9, op_overhead_s=1e-6, cache_bytes=0)
    gemm = Op("mm", "gemm", 2e9, 10, 10, 0, "bfloat16")
    assert op_seconds(gemm, p) == pytest.approx(2e-3)  # compute-bound
    stream = Op("exp", "transcendental", 0, 4e6, 4e6, 1e6, "float32")
    assert op_seconds(stream, p) == pytest.approx(8e-3)  # bandwidth-bound
    tiny = Op("add", "elementwise", 0, 4, 4, 1, "float32")
    assert op_seconds(tiny, p) == pytest.approx(1e-6)  # a launch, hidden only under longer kernels
    cpu = DeviceProfile(
        "cpu", {"float32": 1e12}, 1e9, 1e-6, {"elementwise": 1e-9}, 1 << 30, launch_overlaps=False
    )
    assert op_seconds(Op("add", "elementwise", 0, 8, 4, 1000, "float32"), cpu) == pytest.approx(
        2e-6
    )


def test_gpu_chunk_rows_amortise_the_weight_and_fit_the_budget():
    rows = chunk_rows(201088, torch.bfloat16, LossSpec(), False, "cuda")
    assert rows % GPU_ROW_MULTIPLE == 0 and rows >= 512
    assert rows * 201088 * (4 + 2) <= 2**30  # fp32 logits + bf16 dL/dz
    assert chunk_rows(201088, torch.bfloat16, LossSpec(), False, "cpu") == 2**28 // (201088 * 8)


def test_predicted_h200_shape_at_small_scale():
    """The shape of the issue's claims at a scale CI can trace: fused beats chunked, GEMMs dominate."""
    rows = [
        model.predict_point(impl, 8192, 201088, 2880, 100, torch.bfloat16, model.H200)
        for impl in ("fused", "fused:torch", "chunked")
    ]
    fused, torch_kernels, chunked = rows
    assert fused["predicted_s"] < torch_kernels["predicted_s"] < chunked["predicted_s"]
    assert fused["over_floor"] < 1 / 0.75
    assert max(fused["by_kind"], key=fused["by_kind"].get) == "gemm"


def test_cli_writes_predictions(tmp_path):
    from topkd.cli import main

    out = tmp_path / "m"
    assert (
        main(
            [
                "bench",
                "model",
                "--lengths",
                "512,1024",
                "--vocab",
                "4096",
                "--hidden",
                "64",
                "--impls",
                "fused,chunked,dense",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads((out / "model.json").read_text())
    assert [(r["impl"], r["tokens"]) for r in summary["points"]][:3] == [
        ("fused", 512),
        ("chunked", 512),
        ("dense", 512),
    ]
    assert (out / "model.png").stat().st_size > 0 and summary["stamp"]["commit"]


def test_unknown_device_profile_is_one_clear_line(capsys):
    from topkd.cli import main

    assert main(["bench", "model", "--device", "b200"]) == 2
    assert "expected one of ['h200']" in capsys.readouterr().err


def test_another_device_from_its_rates(tmp_path):
    """--gemm-tflops / --bandwidth-tbs: twice the H200's rates halve the GEMMs' predicted time (launches stay)."""
    from topkd.cli import main

    args = [
        "bench",
        "model",
        "--lengths",
        "65536",
        "--vocab",
        "8192",
        "--hidden",
        "1024",
        "--impls",
        "fused",
    ]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    assert (
        main(
            args
            + [
                "--device",
                "fast",
                "--gemm-tflops",
                "1580",
                "--bandwidth-tbs",
                "8.6",
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    a, b = (json.loads((tmp_path / d / "model.json").read_text()) for d in "ab")
    assert b["profile"]["name"] == "fast"
    gemm = [s["points"][0]["by_kind"]["gemm"] for s in (a, b)]
    # a few tiny GEMMs sit at the launch floor
    assert gemm[1] == pytest.approx(gemm[0] / 2, rel=0.01)
    assert b["points"][0]["predicted_s"] < a["points"][0]["predicted_s"]
