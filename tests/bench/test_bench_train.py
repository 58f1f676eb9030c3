"""`topkd bench train`: the measurements run on a tiny student, and the report judges them correctly."""
import pytest

from topkd.bench import train_point
from topkd.bench.train import check_targets, rows_by_point, table

SCALED_DOWN = {"smollm2": dict(vocab_size=512, hidden_size=36, intermediate_size=64),
               "gemma3-270m": dict(vocab_size=640, hidden_size=32, intermediate_size=64, head_dim=16,
                                   query_pre_attn_scalar=16, sliding_window=16)}


@pytest.mark.parametrize("shape", sorted(SCALED_DOWN))
def test_memory_time_and_loading_measurements_run(monkeypatch, shape):
    for key, value in SCALED_DOWN[shape].items():  # the shape's architecture, scaled down
        monkeypatch.setitem(train_point.SHAPES[shape][2], key, value)
    mem = train_point.measure_memory(shape, "dense", 96, layers=1)
    assert mem["step_peak_bytes"] >= 0 and mem["process_peak_bytes"] > mem["step_peak_bytes"] and mem["step_s"] > 0
    timed = train_point.measure_time(shape, ["fused", "chunked"], 96, layers=1, repeats=2)
    assert set(timed["median_s"]) == {"fused", "chunked"} and all(len(t) == 2 for t in timed["times_s"].values())
    loading = train_point.measure_loading(shape, 64, 2, layers=1, repeats=2)
    assert len(loading["cached_step_s"]) == 2 and loading["cached_over_in_memory"] > 0
    assert all(d > 0 for d in loading["decode_batch_s"])


def _mem(impl, n, peak_gib, status="ok"):
    return {"impl": impl, "tokens": n, "status": status, "process_peak_bytes": peak_gib * 2**30,
            "step_peak_bytes": peak_gib * 2**29}


def test_targets_count_a_dense_oom_as_a_pass_and_judge_ratios():
    result = {"memory": [_mem("fused", 16384, 2.0), _mem("chunked", 16384, 2.2), _mem("dense", 16384, 9.0),
                         _mem("fused", 32768, 3.0), _mem("chunked", 32768, 3.1), _mem("dense", 32768, 0, "oom")],
              "time": [{"tokens": 16384, "status": "ok", "median_s": {"fused": 10.0, "chunked": 9.0, "dense": 12.0}},
                       {"tokens": 32768, "status": "ok", "median_s": {"fused": 20.0, "chunked": 21.0}}]}
    rows = rows_by_point(result)
    targets = check_targets(rows, {"status": "ok", "tokens": 2048, "batch": 4, "cached_over_in_memory": 1.01})
    verdict = {(t["target"], t["tokens"]): t["pass"] for t in targets}
    assert verdict[("dense peak >= 5 x fused peak (process)", 16384)] is False  # 4.5x
    assert verdict[("dense peak >= 5 x fused peak (process)", 32768)] is True  # OOM
    assert verdict[("fused step no slower than chunked", 16384)] is False
    assert verdict[("fused step no slower than chunked", 32768)] is True
    assert verdict[("dense OOM while fused trains", 32768)] is True
    assert verdict[("cache step / in-memory step <= 1.03", 8192)] is True
    assert "OOM" in table(rows, targets) and "FAIL" in table(rows, targets)
