"""`topkd bench train`: the measurements run on a tiny student, and their rows read back."""

import pytest

from topkd.bench import train_point

SCALED_DOWN = {
    "smollm2": dict(vocab_size=512, hidden_size=36, intermediate_size=64),
    "gemma3-270m": dict(
        vocab_size=640,
        hidden_size=32,
        intermediate_size=64,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
    ),
}


@pytest.mark.parametrize("shape", sorted(SCALED_DOWN))
def test_memory_time_and_loading_measurements_run(monkeypatch, shape):
    for key, value in SCALED_DOWN[shape].items():  # the shape's architecture, scaled down
        monkeypatch.setitem(train_point.SHAPES[shape][2], key, value)
    mem = train_point.measure_memory(shape, "dense", 96, layers=1)
    assert (
        mem["step_peak_bytes"] >= 0
        and mem["process_peak_bytes"] > mem["step_peak_bytes"]
        and mem["step_s"] > 0
    )
    timed = train_point.measure_time(shape, ["fused", "chunked"], 96, layers=1, repeats=2)
    assert set(timed["median_s"]) == {"fused", "chunked"} and all(
        len(t) == 2 for t in timed["times_s"].values()
    )
    loading = train_point.measure_loading(shape, 64, 2, layers=1, repeats=2)
    assert len(loading["cached_step_s"]) == 2 and loading["cached_over_in_memory"] > 0
    assert all(d > 0 for d in loading["decode_batch_s"])
