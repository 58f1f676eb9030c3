"""`topkd cache export --format axolotl` and `topkd cache import`: Axolotl's columns and shift, one row per
document, a round trip that gives the rows back (ids exact, log-probs within the uint8 quantisation, the tail
from the stored mass), refusals. The Parquet steps need `datasets` (extra topkd[hf]): slow tests."""
import json

import numpy as np
import pytest
import torch

from topkd.cache import TopKCache
from topkd.cache.interchange import axolotl_row, imported_sequence
from topkd.cli import main
from topkd.data import TopKDataset


def test_a_row_is_shifted_as_axolotl_reads_it(built_cache):
    item = TopKDataset(TopKCache(built_cache), packing="none")[2]
    row = axolotl_row(item)
    n, k = len(item["input_ids"]), item["teacher_ids"].shape[1]
    assert len(row["target_token_ids"]) == n and len(row["target_token_ids"][0]) == k
    assert row["target_mask"][0] == [0] * k and row["labels"][0] == -100  # position 0 predicts nothing
    for i in range(1, n):  # target i: the teacher's distribution of token i (from row i - 1)
        assert row["target_token_ids"][i] == item["teacher_ids"][i - 1].tolist()
        assert row["target_logprobs"][i] == pytest.approx(item["teacher_logprobs"][i - 1].tolist())
        assert row["target_mask"][i] == [int(item["kd_mask"][i - 1])] * k
        assert row["labels"][i] == (item["input_ids"][i] if item["labels"][i - 1] >= 0 else -100)


@pytest.mark.slow
def test_export_then_import_round_trips_the_rows(built_cache, teacher_dir, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    assert main(["cache", "export", built_cache, "--format", "axolotl", "--out", str(tmp_path / "ax")]) == 0
    rows = datasets.load_dataset(str(tmp_path / "ax"), split="train")
    cache = TopKCache(built_cache)
    assert len(rows) == len(TopKDataset(cache, packing="none"))  # one row per document piece
    assert set(rows.column_names) == {"input_ids", "attention_mask", "labels", "target_token_ids",
                                      "target_logprobs", "target_mask"}
    assert json.load(open(tmp_path / "ax" / "topkd_export.json"))["fingerprint"] == cache.fingerprint
    trainable = [i for i in range(len(rows)) if all(all(m) for m in rows[i]["target_mask"][1:])]
    rows.select(trainable).to_parquet(str(tmp_path / "clean" / "data.parquet"))
    assert main(["cache", "import", str(tmp_path / "clean"), "--tokenizer", teacher_dir,
                 "--vocab-size", str(cache.vocab_size), "--out", str(tmp_path / "imp")]) == 0
    imported = TopKCache(str(tmp_path / "imp"))
    assert imported.verify() == [] and imported.k == cache.k and imported.temperatures == []
    assert imported.manifest["build"]["tail"].startswith("unknown")
    first = imported[0]
    row = rows[trainable[0]]
    assert first["input_ids"].tolist() == row["input_ids"][:-1]
    assert torch.equal(first["teacher_ids"], torch.tensor(row["target_token_ids"][1:]))
    got = first["teacher_logprobs"].numpy()
    assert np.abs(got - np.asarray(row["target_logprobs"][1:])).max() < 0.05  # re-quantised log-probs


def test_masked_positions_are_refused_and_rows_rank_ordered():
    row = {"input_ids": [5, 6, 7], "target_token_ids": [[0, 1], [3, 4], [5, 6]],
           "target_logprobs": [[-1e9, -1e9], [-1.0, -2.0], [-0.5, -3.0]], "target_mask": [[0, 0], [1, 1], [0, 0]]}
    with pytest.raises(ValueError, match="import: row 4 position 2: expected a counted target"):
        imported_sequence(row, 4)
    seq = imported_sequence({**row, "target_mask": [[0, 0], [1, 1], [1, 1]],
                             "target_logprobs": [[0, 0], [-2.0, -1.0], [-0.5, -3.0]]}, 0)
    assert seq.ids.tolist() == [[4, 3], [5, 6]] and seq.input_ids.tolist() == [5, 6]  # rank order; last token dropped
    assert np.exp(seq.log_tail[0]) == pytest.approx(1 - np.exp(-1.0) - np.exp(-2.0), rel=1e-5)


def test_bad_flags_are_refused_before_anything_runs(built_cache, teacher_dir, tmp_path):
    assert main(["cache", "export", built_cache, "--format", "parquet", "--out", str(tmp_path / "x")]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["cache", "export", built_cache, "--out", str(tmp_path / "full")]) == 2
    assert main(["cache", "import", str(tmp_path), "--tokenizer", teacher_dir, "--out", str(tmp_path / "y")]) == 2
