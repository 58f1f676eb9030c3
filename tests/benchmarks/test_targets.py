"""benchmarks/targets.py: the issues' targets judged on made-up results, an OOM counted as a pass, a CLI that
fails when a target fails."""

import json
import os

from benchmarks.targets import (
    judge_directory,
    judge_gpu,
    judge_loss,
    judge_model,
    judge_train,
    main,
)
from topkd.bench.train import rows_by_point


def _verdict(rows: list[dict]) -> dict:
    return {(t["target"], t["tokens"]): t["pass"] for t in rows}


def _mem(impl, n, peak_gib, status="ok"):
    return {
        "impl": impl,
        "tokens": n,
        "status": status,
        "process_peak_bytes": peak_gib * 2**30,
        "step_peak_bytes": peak_gib * 2**29,
    }


def test_train_targets_count_a_dense_oom_as_a_pass_and_judge_ratios():
    result = {
        "memory": [
            _mem("fused", 16384, 2.0),
            _mem("chunked", 16384, 2.2),
            _mem("dense", 16384, 9.0),
            _mem("fused", 32768, 3.0),
            _mem("chunked", 32768, 3.1),
            _mem("dense", 32768, 0, "oom"),
        ],
        "time": [
            {
                "tokens": 16384,
                "status": "ok",
                "median_s": {"fused": 10.0, "chunked": 9.0, "dense": 12.0},
            },
            {"tokens": 32768, "status": "ok", "median_s": {"fused": 20.0, "chunked": 21.0}},
        ],
        "loading": {"status": "ok", "cached_over_in_memory": 1.01},
    }
    summary = {
        "bench": "train",
        "points": rows_by_point(result),
        "raw": result,
        "config": {"loading_tokens": 2048, "loading_batch": 4},
    }
    verdict = _verdict(judge_train(summary))
    assert verdict[("dense peak >= 5 x fused peak (process)", 16384)] is False  # 4.5x
    assert verdict[("dense peak >= 5 x fused peak (process)", 32768)] is True  # OOM
    assert verdict[("fused step no slower than chunked", 16384)] is False
    assert verdict[("fused step no slower than chunked", 32768)] is True
    assert verdict[("dense OOM while fused trains", 32768)] is True
    assert verdict[("cache step / in-memory step <= 1.03", 8192)] is True


def _loss_row(
    impl, n, peak_gib, time_over_floor=1.0, time_vs_fused=1.0, mem_vs_fused=1.0, status="ok"
):
    return {
        "impl": impl,
        "tokens": n,
        "status": status,
        "peak_bytes": peak_gib * 2**30,
        "floor_bytes": 2**30,
        "chunk_budget_bytes": 2**28,
        "time_over_floor": time_over_floor,
        "time_vs_fused": time_vs_fused,
        "mem_vs_fused": mem_vs_fused,
    }


def test_loss_targets_judge_floors_and_baselines():
    rows = [
        _loss_row("fused", 16384, 1.3, time_over_floor=1.1),
        _loss_row("chunked", 16384, 2, time_vs_fused=1.2),
        _loss_row("dense", 16384, 0, status="oom"),
        _loss_row("fused", 4096, 1.5, time_over_floor=1.2),
        _loss_row("chunked", 4096, 2, time_vs_fused=0.9),
    ]
    verdict = _verdict(judge_loss({"bench": "loss", "points": rows}))
    assert verdict[("fused peak <= 1.15 x floor + chunk budget", 16384)]  # 1.3 <= 1.15 + 0.25
    assert not verdict[("fused peak <= 1.15 x floor + chunk budget", 4096)]
    assert verdict[("fused time <= 1.15 x three-GEMM floor", 16384)]
    assert not verdict[("fused time <= 1.15 x three-GEMM floor", 4096)]
    assert (
        verdict[("fused faster than chunked", 16384)]
        and not verdict[("fused faster than chunked", 4096)]
    )
    assert verdict[("dense peak >= 10 x fused peak", 16384)]  # dense OOM


def test_model_targets_are_labelled_predictions():
    points = [
        {
            "impl": "fused",
            "tokens": 32768,
            "over_floor": 1.2,
            "predicted_s": 1.0,
            "peak_bytes": 4 * 2**30,
        },
        {
            "impl": "chunked",
            "tokens": 32768,
            "over_floor": 1.5,
            "predicted_s": 1.3,
            "peak_bytes": 9 * 2**30,
        },
    ]
    rows = judge_model({"bench": "model", "points": points})
    assert all(t["target"].startswith("predicted: ") and t["pass"] for t in rows) and len(rows) == 3


def test_gpu_targets_are_judged_from_the_points(tmp_path):
    (tmp_path / "check.json").write_text(
        json.dumps({"impls": [{"pass": True}], "gemm": {"tflops": 800.0}})
    )
    points = [
        {
            "impl": "fused",
            "tokens": 32768,
            "status": "ok",
            "peak_bytes": 4.5 * 2**30,
            "time_s": 1.0,
            "flops": 700e12,
        },
        {
            "impl": "chunked",
            "tokens": 32768,
            "status": "ok",
            "peak_bytes": 9 * 2**30,
            "time_s": 1.2,
            "flops": 700e12,
        },
        {
            "impl": "fused",
            "tokens": 262144,
            "status": "ok",
            "peak_bytes": 12 * 2**30,
            "time_s": 10.0,
            "flops": 5600e12,
        },
    ]
    verdict = _verdict(judge_gpu({"points": points}, str(tmp_path)))
    assert (
        verdict[("fused peak <= 5.0 GiB", 32768)]
        and not verdict[("fused peak <= 11.0 GiB", 262144)]
    )
    assert verdict[("fused >= 75% of the bf16 GEMM rate (800 TFLOP/s)", 32768)]  # 700 of 800
    assert not verdict[("fused >= 75% of the bf16 GEMM rate (800 TFLOP/s)", 262144)]  # 560 of 800
    assert verdict[("fused faster than chunked", 32768)]


def test_cli_reads_a_directory_writes_targets_and_fails_on_a_failure(tmp_path, capsys):
    rows = [_loss_row("fused", 1024, 1.3, time_over_floor=1.1)]
    (tmp_path / "loss.json").write_text(json.dumps({"bench": "loss", "points": rows}))
    (tmp_path / "other.json").write_text(json.dumps([1, 2]))  # not a result file: ignored
    assert main([str(tmp_path), "--write"]) == 0
    assert "2/2 targets pass" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "targets.json").read_text())) == 2
    rows[0]["time_over_floor"] = 1.3
    (tmp_path / "loss.json").write_text(json.dumps({"bench": "loss", "points": rows}))
    assert main([str(tmp_path)]) == 1 and "FAIL" in capsys.readouterr().out
    assert {t["bench"] for t in judge_directory(str(tmp_path))} == {"loss"}


def test_stored_results_still_judge():
    """The stored CPU results (written before the targets left the package) read through the same judges."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = judge_directory(os.path.join(root, "benchmarks", "results", "loss-cpu-gpu-driver"))
    assert rows and all(t["pass"] for t in rows)


def test_cache_target_arms_are_judged():
    from benchmarks.targets import _judge_target_arms

    arms = {
        "sampled N=50": {
            "targets": "sampled",
            "samples": 50,
            "tokens": 10,
            "bytes_per_token": 41.0,
            "decode_tokens_per_s": 3e5,
        },
        "top-100": {
            "targets": "topk",
            "tokens": 10,
            "bytes_per_token": 216.0,
            "decode_tokens_per_s": 1.5e5,
        },
        "top-p 0.95": {
            "targets": "topp",
            "tokens": 10,
            "bytes_per_token": 160.0,
            "decode_tokens_per_s": 1e5,
        },
    }
    verdicts = {t["target"]: t["pass"] for t in _judge_target_arms(arms)}
    assert verdicts == {
        "sampled N=50 <= 40 bytes/token": False,
        "sampled N=50 decode >= 200K tokens/s": True,
        "top-100 decode >= 200K tokens/s": False,
    }
