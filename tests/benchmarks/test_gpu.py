"""benchmarks/gpu.sh end to end at toy sizes on the CPU (GPU_SMOKE=1): every step runs and writes its files,
so the one call on a GPU machine is not where a typo is found."""
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_script_smoke_runs_every_step(tmp_path):
    env = {**os.environ, "GPU_SMOKE": "1", "OUT": str(tmp_path), "PY": os.path.join(ROOT, ".venv", "bin", "python")}
    subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh")], cwd=ROOT, env=env, check=True, timeout=900)
    assert len(os.listdir(tmp_path)) <= 8, "the GPU machine hands back at most 8 files"
    check = json.load(open(tmp_path / "check.json"))
    assert len(check["impls"]) == 16 and all(row["pass"] for row in check["impls"])
    assert check["gemm"]["tflops"] > 0
    points = json.load(open(tmp_path / "loss.json"))["points"]
    assert {p["impl"] for p in points} == {"fused", "fused:torch", "chunked", "dense", "liger_jsd", "torch_lce"}
    assert all(p["status"] in ("ok", "unavailable") for p in points)
    assert all(p["predicted_s"] > 0 for p in points if p["impl"] in ("fused", "chunked", "dense"))
    train = json.load(open(tmp_path / "train.json"))["points"]
    assert [(r["impl"], r["status"]) for r in train] == [("fused", "ok"), ("chunked", "ok"), ("dense", "ok")]
    assert all(r["tflops"] > 0 and r["peak_bytes"] > 0 for r in train)
    targets = json.load(open(tmp_path / "targets.json"))
    assert targets[0]["pass"] and any("faster than chunked" in t["target"] for t in targets)
    assert "meas/pred" in (tmp_path / "report.txt").read_text()
