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
    assert verdict["fused >= 75% of the bf16 GEMM rate (800 TFLOP/s) at 32768"]  # 700 of 800
    assert not verdict["fused >= 75% of the bf16 GEMM rate (800 TFLOP/s) at 262144"]  # 560 of 800
    assert verdict["fused faster than chunked at 32768"]


def test_json_lines_record_a_timeout_or_a_crash_and_skip_the_rest():
    """Real processes: a point that hangs is killed after its timeout, a crash is an error; later points skipped."""
    import sys

    from topkd.bench.common import run_json_lines

    hang = "import json, time; print(json.dumps({'status': 'ok'}), flush=True); time.sleep(60)"
    rows = run_json_lines([sys.executable, "-c", hang], [1, 2, 3], 2.0, dict(os.environ))
    assert [rows[k]["status"] for k in (1, 2, 3)] == ["ok", "timeout", "skipped"]
    crash = "import json; print(json.dumps({'status': 'ok'}), flush=True); raise SystemExit('boom')"
    rows = run_json_lines([sys.executable, "-c", crash], ["a", "b"], 30.0, dict(os.environ))
    assert rows["a"]["status"] == "ok" and rows["b"] == {"status": "error", "error": ["boom"]}
    chatty = "import json, sys; sys.stderr.write('x' * 2**20 + '\\nlast\\n'); print(json.dumps({'status': 'ok'}))"
    assert run_json_lines([sys.executable, "-c", chatty], ["a"], 30.0, dict(os.environ)) == {"a": {"status": "ok"}}
