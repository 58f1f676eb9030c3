"""benchmarks/gpu.sh end to end at toy sizes on the CPU (GPU_SMOKE=1): every step runs and writes its files,
so the one call on a GPU machine is not where a typo is found. Also the targets' judgement on made-up points."""
import json
import os
import subprocess

import pytest

from topkd.bench.gpu import judge

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_script_smoke_runs_every_step(tmp_path):
    env = {**os.environ, "GPU_SMOKE": "1", "OUT": str(tmp_path), "PY": os.path.join(ROOT, ".venv", "bin", "python")}
    subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh")], cwd=ROOT, env=env, check=True, timeout=900)
    check = json.load(open(tmp_path / "check.json"))
    assert len(check["impls"]) == 16 and all(row["pass"] for row in check["impls"])
    assert check["gemm"]["tflops"] > 0
    points = json.load(open(tmp_path / "loss" / "loss.json"))["points"]
    assert {p["impl"] for p in points} == {"fused", "triton", "chunked", "liger_jsd", "torch_lce"}
    assert all(p["status"] == "ok" for p in points)
    targets = json.load(open(tmp_path / "targets.json"))["targets"]
    assert targets[0]["pass"] and any("faster than chunked" in t["target"] for t in targets)


def test_targets_are_judged_from_the_points():
    check = {"impls": [{"pass": True}], "gemm": {"tflops": 800.0}}
    points = [{"impl": "fused", "tokens": 32768, "status": "ok", "peak_bytes": 4.5 * 2**30, "time_s": 1.0,
               "flops": 700e12},
              {"impl": "chunked", "tokens": 32768, "status": "ok", "peak_bytes": 9 * 2**30, "time_s": 1.2,
               "flops": 700e12},
              {"impl": "fused", "tokens": 262144, "status": "ok", "peak_bytes": 12 * 2**30, "time_s": 10.0,
               "flops": 5600e12}]
    verdict = {t["target"]: t["pass"] for t in judge(points, check)}
    assert verdict["fused peak <= 5.0 GiB at 32768 tokens"] and not verdict["fused peak <= 11.0 GiB at 262144 tokens"]
    assert verdict["fused >= 75% of bf16 GEMM (800 TFLOP/s) at 32768"]  # 700 of 800
    assert not verdict["fused >= 75% of bf16 GEMM (800 TFLOP/s) at 262144"]  # 560 of 800
    assert verdict["fused faster than chunked at 32768"]
