"""benchmarks/gpu.sh end to end at toy sizes on the CPU (GPU_SMOKE=1): every stage runs and writes its files,
so the one call on a GPU machine is not where a typo is found; a stage that crashes or hangs costs only itself.

    python -m pytest -m slow tests/benchmarks/test_gpu.py   # ~4 min; marked slow: make test-slow runs it, and
    # make test-compat does too, on the GPU machine's stack (Python 3.12, torch 2.11)
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_script_smoke_runs_every_step(tmp_path):
    env = {**os.environ, "GPU_SMOKE": "1", "OUT": str(tmp_path), "PY": sys.executable}
    subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu.sh")],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=900,
    )
    assert len(os.listdir(tmp_path)) <= 7, "the GPU machine hands back at most 7 files"
    log = (tmp_path / "log.txt").read_text()
    assert "gpu.sh: stage" not in log, log  # no stage failed or timed out
    check = json.load(open(tmp_path / "check.json"))
    assert len(check["impls"]) == 20 and all(row["pass"] for row in check["impls"]), check["impls"]
    # the Triton kernels ran
    assert {row["impl"] for row in check["impls"]} >= {"triton", "fused:torch"}
    assert check["gemm"]["tflops"] > 0
    points = json.load(open(tmp_path / "loss.json"))["points"]
    assert {p["impl"] for p in points} == {
        "fused",
        "fused:torch",
        "triton",
        "chunked",
        "dense",
        "liger_jsd",
        "torch_lce",
    }
    assert all(p["status"] in ("ok", "unavailable") for p in points)
    assert all(p["status"] == "ok" for p in points if p["impl"] == "triton")
    assert all(p["predicted_s"] > 0 for p in points if p["impl"] in ("fused", "chunked", "dense"))
    train = json.load(open(tmp_path / "train.json"))["points"]
    assert [(r["impl"], r["status"]) for r in train] == [
        ("fused", "ok"),
        ("chunked", "ok"),
        ("dense", "ok"),
    ]
    assert all(r["tflops"] > 0 and r["peak_bytes"] > 0 for r in train)
    targets = json.load(open(tmp_path / "targets.json"))
    assert targets[0]["pass"] and any("faster than chunked" in t["target"] for t in targets)
    assert "meas/pred" in (tmp_path / "report.txt").read_text()


FAKE_PY = """#!/usr/bin/env bash
# a stand-in python for gpu.sh: the check stage dies as on a CUDA fault, gemm hangs, loss writes one row
# and is killed, train and predict do nothing; report is the real one
case "$3" in
    check) kill -9 $$ ;;
    gemm) sleep 600 ;;
    loss) echo '{"bench": "gpu", "points": [{"impl": "fused", "tokens": 8192, "status": "ok", "peak_bytes": 1,
        "time_s": 1.0, "flops": 1}]}' > "$OUT/loss.json"; kill -9 $$ ;;
    train|predict) exit 0 ;;
esac
exec "$REAL_PY" "$@"
"""


@pytest.mark.slow
def test_a_stage_that_crashes_or_hangs_costs_only_itself(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "GPU_SMOKE": "1",
        "OUT": str(out),
        "PY": str(fake),
        "REAL_PY": sys.executable,
    }
    subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu.sh")],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=120,
    )
    log = (out / "log.txt").read_text()
    assert (
        "gpu.sh: stage check failed (exit 137)" in log
        and "gpu.sh: stage loss failed (exit 137)" in log
    ), log
    assert "gpu.sh: stage gemm stopped at its 20 s limit" in log
    report = (out / "report.txt").read_text()  # the report stage still ran, on what the others left
    assert "bf16 GEMM: not measured" in report and "fused           8192          ok" in report


def test_a_failing_prediction_is_noted_on_its_row_and_the_measurements_stay(tmp_path, monkeypatch):
    from benchmarks import gpu
    from topkd import bench

    rows = [
        {"impl": impl, "tokens": 257, "status": "ok", "time_s": 0.5, "flops": 1}
        for impl in ("fused", "dense")
    ]
    gpu._dump(str(tmp_path), "loss.json", {"bench": "gpu", "points": rows})
    real_point = bench.predict_point

    def point(impl, *args):
        if impl == "dense":
            raise RuntimeError("no meta kernel for this op")
        return real_point(impl, *args)

    monkeypatch.setattr(bench, "predict_point", point)
    monkeypatch.setattr(gpu, "MODEL_H200", str(tmp_path / "absent.json"))
    gpu.stage_predict(str(tmp_path), gpu.SMOKE)
    fused, dense = json.load(open(tmp_path / "loss.json"))["points"]
    assert fused["predicted_s"] > 0 and fused["measured_over_predicted"] > 0
    assert (
        dense["prediction_error"] == "RuntimeError: no meta kernel for this op"
        and dense["time_s"] == 0.5
    )
