"""`topkd bench loss` runs end to end on a tiny sweep: table, CSV, JSON, PNG, JSON last line, OOM as a result."""

import csv
import json

import pytest

from topkd.bench.loss import LossBenchConfig, add_ratios, run_loss_bench, table
from topkd.cli import main


@pytest.mark.slow
def test_tiny_sweep_writes_every_output(tmp_path, capsys):
    out = tmp_path / "bench"
    main(
        [
            "bench",
            "loss",
            "--lengths",
            "64,96",
            "--impls",
            "fused,dense",
            "--vocab",
            "512",
            "--hidden",
            "16",
            "--k",
            "8",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(p["impl"], p["tokens"], p["status"]) for p in last["points"]] == [
        ("fused", 64, "ok"),
        ("dense", 64, "ok"),
        ("fused", 96, "ok"),
        ("dense", 96, "ok"),
    ]
    rows = list(csv.DictReader(open(out / "loss.csv")))
    assert len(rows) == 4 and all(r["commit"] and r["machine"] and r["torch"] for r in rows)
    assert (out / "loss.png").stat().st_size > 10_000
    main(["bench", "loss", "--out", str(out), "--report-only"])
    assert "time/fused" in capsys.readouterr().out
    dense96 = next(p for p in last["points"] if p["impl"] == "dense" and p["tokens"] == 96)
    assert (
        dense96["peak_bytes"] > 0
        and dense96["time_over_floor"] > 0
        and dense96["time_vs_fused"] > 0
    )
    assert json.load(open(out / "loss.json"))["stamp"]["huge_pages"] == "time only"


def test_out_of_memory_is_a_result_not_a_crash(tmp_path):
    cfg = LossBenchConfig(
        lengths=[4096],
        impls=["dense"],
        vocab=65536,
        hidden=16,
        k=8,
        repeats=1,
        mem_limit_gib=3.0,
        out=str(tmp_path),
    )
    summary = run_loss_bench(cfg)
    assert summary["points"][0]["status"] == "oom"


def test_table_marks_failures():
    rows = [
        {
            "impl": "fused",
            "tokens": 8,
            "status": "ok",
            "peak_bytes": 2,
            "floor_bytes": 1,
            "time_s": 2.0,
            "floor_time_s": 1.0,
            "flops": 6e9,
        },
        {"impl": "dense", "tokens": 8, "status": "oom"},
    ]
    add_ratios(rows)
    assert rows[0]["mem_over_floor"] == 2 and rows[0]["time_vs_fused"] == 1
    assert "OOM" in table(rows)


def test_a_fused_peak_of_zero_gives_no_memory_ratio():
    rows = [
        {
            "impl": "fused",
            "tokens": 8,
            "status": "ok",
            "peak_bytes": 0,
            "floor_bytes": 1,
            "time_s": 2.0,
            "floor_time_s": 1.0,
            "flops": 6e9,
        },
        {
            "impl": "dense",
            "tokens": 8,
            "status": "ok",
            "peak_bytes": 5,
            "floor_bytes": 1,
            "time_s": 4.0,
            "floor_time_s": 1.0,
            "flops": 6e9,
        },
    ]
    add_ratios(rows)
    assert "mem_vs_fused" not in rows[1] and rows[1]["time_vs_fused"] == 4.0 / 2.0
    assert "nan" in table(rows)


def test_time_ratios_between_impls_use_each_ones_own_floor():
    rows = [
        # measured while the machine was twice as slow
        {
            "impl": "dense",
            "tokens": 8,
            "status": "ok",
            "peak_bytes": 5,
            "floor_bytes": 1,
            "time_s": 4.0,
            "floor_time_s": 2.0,
            "flops": 6e9,
        },
        {
            "impl": "fused",
            "tokens": 8,
            "status": "ok",
            "peak_bytes": 1,
            "floor_bytes": 1,
            "time_s": 2.0,
            "floor_time_s": 1.0,
            "flops": 6e9,
        },
    ]
    add_ratios(rows)
    assert rows[0]["time_vs_fused"] == 1.0 and rows[0]["raw_time_vs_fused"] == 2.0
