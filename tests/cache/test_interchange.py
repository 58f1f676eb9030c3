"""`topkd cache export --format axolotl` and `topkd cache import`: Axolotl 0.18's columns and pairing (its KD step
restated from its source and run on exported rows), one row per document, a round trip that gives the rows back
(ids exact, log-probs within the uint8 quantisation, the tail from the stored mass), refusals, a shifted dataset
refused. The Parquet steps need `datasets` (extra topkd[hf]): slow tests."""

import json
import os

import numpy as np
import pytest
import torch

from topkd import TopKDataset
from topkd.cache import TopKCache
from topkd.cache.reading.interchange import axolotl_row, imported_sequence
from topkd.cli import main


def test_a_row_is_laid_out_as_axolotl_0_18_pairs_it(built_cache):
    item = TopKDataset(TopKCache(built_cache), packing="none")[2]
    row = axolotl_row(item)
    n, k = len(item["input_ids"]), item["teacher_ids"].shape[1]
    assert len(row["target_token_ids"]) == n and len(row["target_token_ids"][0]) == k
    assert row["labels"][0] == -100  # no hidden state before token 0 predicts it
    # target row j: the teacher's distribution of token j + 1, for hidden state j
    for j in range(n):
        assert row["target_token_ids"][j] == item["teacher_ids"][j].tolist()
        assert row["target_logprobs"][j] == pytest.approx(item["teacher_logprobs"][j].tolist())
        assert row["target_mask"][j] == [int(item["kd_mask"][j])] * k
    for i in range(1, n):  # Axolotl's loss shifts labels: hidden i - 1 is scored against labels[i]
        assert row["labels"][i] == (item["input_ids"][i] if item["labels"][i - 1] >= 0 else -100)


def axolotl_0_18_loss(model, rows: list[dict]) -> tuple[float, float, int]:
    """Axolotl v0.18.0's KD step restated from its source (DataCollatorForKD, AxolotlKDTrainer.compute_loss,
    LigerFusedLinearKLTopKLogprobFunction; defaults: kd_normalize_topk unset, kd_beta 0, T = 1): right padding
    (log-probs -1e9, ids 0, mask 0, labels -100); hidden state j paired with target row j; forward KL over the
    valid top-K entries of the teacher's log-probs against the student's full-vocabulary log-probs; CE of hidden
    j against labels[j + 1]. Returns (KD sum, CE sum, valid rows). Axolotl itself is not installed here."""
    longest = max(len(r["input_ids"]) for r in rows)

    def pad(r: dict, key: str, fill) -> list:
        return r[key] + [fill] * (longest - len(r[key]))

    k = len(rows[0]["target_token_ids"][0])
    ids = torch.tensor([pad(r, "target_token_ids", [0] * k) for r in rows])
    lp = torch.tensor([pad(r, "target_logprobs", [-1e9] * k) for r in rows], dtype=torch.float32)
    mask = torch.tensor([pad(r, "target_mask", [0] * k) for r in rows]).bool()
    labels = torch.tensor([pad(r, "labels", -100) for r in rows])
    inputs = torch.tensor([pad(r, "input_ids", 0) for r in rows])
    with torch.no_grad():
        # one document per row: positions 0..L-1
        hidden = model.get_decoder()(input_ids=inputs).last_hidden_state
        logq = torch.log_softmax(hidden @ model.lm_head.weight.T, dim=-1).reshape(
            -1, model.config.vocab_size
        )
    ids, lp, mask = ids.reshape(-1, k), lp.reshape(-1, k), mask.reshape(-1, k)
    q_at = logq.gather(1, ids)
    kd = (lp[mask].exp() * (lp[mask] - q_at[mask])).sum()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    ce = torch.nn.functional.nll_loss(logq, shifted, ignore_index=-100, reduction="sum")
    return float(kd), float(ce), int(mask.any(-1).sum())


def test_axolotls_own_step_on_an_exported_batch_is_the_teacher_matching_itself(built_cache):
    """The teacher as its own student under Axolotl 0.18's pairing: KD ~ 0 (the cache's quantisation), CE its
    own NLL. One position off (the earlier export: row i held token i's distribution) is far from it."""
    cache = TopKCache(built_cache)
    model = cache.load_teacher().model
    data = TopKDataset(cache, packing="none")
    rows = [axolotl_row(data[i]) for i in range(6)]
    kd, ce, n = axolotl_0_18_loss(model, rows)
    assert n > 100 and abs(kd) / n < 0.01 and ce > 0
    shifted = [
        {
            **r,
            "target_token_ids": [list(range(len(r["target_token_ids"][0])))]
            + r["target_token_ids"][:-1],
            "target_logprobs": [[-1e9] * len(r["target_logprobs"][0])] + r["target_logprobs"][:-1],
            "target_mask": [[0] * len(r["target_mask"][0])] + r["target_mask"][:-1],
        }
        for r in rows
    ]
    assert axolotl_0_18_loss(model, shifted)[0] / n > 1.0


@pytest.mark.slow
def test_export_then_import_round_trips_the_rows(built_cache, teacher_dir, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    assert (
        main(["cache", "export", built_cache, "--format", "axolotl", "--out", str(tmp_path / "ax")])
        == 0
    )
    assert "Generating" not in capsys.readouterr().err  # the datasets library's own bars stay quiet
    rows = datasets.load_dataset(str(tmp_path / "ax"), split="train")
    cache = TopKCache(built_cache)
    assert len(rows) == len(TopKDataset(cache, packing="none"))  # one row per document piece
    assert set(rows.column_names) == {
        "input_ids",
        "attention_mask",
        "labels",
        "target_token_ids",
        "target_logprobs",
        "target_mask",
    }
    assert (
        json.load(open(tmp_path / "ax" / "topkd_export.json"))["fingerprint"] == cache.fingerprint
    )
    assert (
        main(
            [
                "cache",
                "import",
                str(tmp_path / "ax"),
                "--tokenizer",
                teacher_dir,
                "--vocab-size",
                str(cache.vocab_size),
                "--out",
                str(tmp_path / "imp"),
            ]
        )
        == 0
    )
    # every row, the uncounted ones (separators) as masked rows
    imported = TopKCache(str(tmp_path / "imp"))
    assert imported.verify() == [] and imported.k == cache.k and imported.temperatures == []
    assert imported.manifest["build"]["tail"].startswith("unknown")
    assert imported.counted_tokens == sum(
        int(sum(m[0] for m in rows[i]["target_mask"])) for i in range(len(rows))
    )
    first, row = imported[0], rows[0]
    assert first["input_ids"].tolist() == row["input_ids"]  # every token: row j is target row j
    counted = torch.tensor([m[0] == 1 for m in row["target_mask"]])
    assert torch.equal(
        first["teacher_ids"][counted], torch.tensor(row["target_token_ids"])[counted]
    )
    got = first["teacher_logprobs"].numpy()[counted.numpy()]
    # re-quantised
    assert np.abs(got - np.asarray(row["target_logprobs"])[counted.numpy()]).max() < 0.05
    piece = TopKDataset(cache, packing="none")[0]  # the exported piece's own rows, in place
    assert torch.equal(first["teacher_ids"][counted], piece["teacher_ids"][counted])


@pytest.mark.slow
def test_a_masked_chat_cache_exported_by_topkd_imports_back(teacher_dir, tmp_path):
    """Its prompt rows have target_mask 0: the import refused every such row before."""
    pytest.importorskip("datasets")
    from tests.cache.tiny import make_chat_teacher
    from tests.conftest import cache_config
    from tests.data.test_chat import CONVERSATION
    from topkd.cache import build

    chat = make_chat_teacher(teacher_dir, str(tmp_path / "chat-teacher"))
    (tmp_path / "chat.jsonl").write_text((json.dumps({"messages": CONVERSATION}) + "\n") * 3)
    build(
        cache_config(
            chat, str(tmp_path / "chat.jsonl"), tmp_path / "c", seq_len=64, temperatures=[]
        )
    )
    assert TopKCache(str(tmp_path / "c")).manifest["format_version"] == 3
    assert main(["cache", "export", str(tmp_path / "c"), "--out", str(tmp_path / "ax")]) == 0
    assert (
        main(
            [
                "cache",
                "import",
                str(tmp_path / "ax"),
                "--tokenizer",
                chat,
                "--out",
                str(tmp_path / "imp"),
            ]
        )
        == 0
    )
    imported, original = TopKCache(str(tmp_path / "imp")), TopKCache(str(tmp_path / "c"))
    assert imported.verify() == [] and imported.manifest["format_version"] == 3
    # every assistant target, no prompt row
    assert imported.counted_tokens == original.counted_tokens
    assert imported.counted_tokens < imported.tokens  # the prompts came back as masked rows
    row, back = original[0], imported[0]
    assert torch.equal(back["row_mask"], row["row_mask"][: len(back["row_mask"])])
    keep = back["row_mask"]
    assert torch.equal(back["teacher_ids"][keep], row["teacher_ids"][: len(keep)][keep])


@pytest.mark.slow
def test_import_refuses_unusable_datasets_in_one_line(teacher_dir, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    row = {
        "input_ids": [5, 6, 7],
        "target_token_ids": [[0, 1], [3, 4], [5, 6]],
        "target_logprobs": [[-1.0, -2.0], [-1.0, -2.0], [-0.5, -3.0]],
        "target_mask": [[0, 0], [1, 1], [1, 1]],
    }
    cases = {
        "missing": [{k: v for k, v in row.items() if k != "target_mask"}],
        "empty": [],
        "nulls": [row, {**row, "target_logprobs": None}],
        "short": [{**row, "input_ids": [5, 6]}],
    }
    words = {
        "missing": "expected rows with the columns",
        "empty": "got 0 rows",
        "nulls": "import: row 1 target_logprobs: expected a [L][K]",
        "short": "import: row 0: expected input_ids [L] and",
    }
    for name, rows in cases.items():
        d = tmp_path / name
        d.mkdir()
        table = (
            datasets.Dataset.from_list(rows)
            if rows
            else datasets.Dataset.from_dict({c: [] for c in row})
        )
        table.to_parquet(str(d / "data.parquet"))
        capsys.readouterr()
        assert (
            main(
                [
                    "cache",
                    "import",
                    str(d),
                    "--tokenizer",
                    teacher_dir,
                    "--out",
                    str(tmp_path / f"o-{name}"),
                ]
            )
            == 2
        )
        # after datasets' own progress lines
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("topkd cache import: error: ") and words[name] in last, (name, last)
        assert not (tmp_path / f"o-{name}").exists()


@pytest.mark.slow
def test_export_of_a_damaged_cache_is_refused_and_leaves_no_out(built_cache, tmp_path, capsys):
    import shutil

    pytest.importorskip("datasets")
    damaged = shutil.copytree(built_cache, tmp_path / "c")
    shard = damaged / "shards" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(data)
    assert main(["cache", "export", str(damaged), "--out", str(tmp_path / "ax")]) == 2
    assert "sha256 mismatch" in capsys.readouterr().err and not (tmp_path / "ax").exists()
    # repaired: exports
    shutil.copy(os.path.join(built_cache, "shards", "shard-00001.safetensors"), shard)
    assert main(["cache", "export", str(damaged), "--out", str(tmp_path / "ax")]) == 0


GOOD = {
    "input_ids": [5, 6, 7],
    "target_token_ids": [[0, 1], [3, 4], [5, 6]],
    "target_logprobs": [[-1e9, -1e9], [-2.0, -1.0], [-0.5, -3.0]],
    "target_mask": [[0, 0], [1, 1], [1, 1]],
}


def test_rows_are_rank_ordered_and_masked_positions_kept_as_masked_rows():
    seq = imported_sequence(GOOD, 0, vocab=10)
    # rank order
    assert seq.ids.tolist() == [[0, 1], [4, 3], [5, 6]] and seq.input_ids.tolist() == [5, 6, 7]
    assert seq.row_mask.tolist() == [False, True, True]  # row 0 (mask 0): stored, not counted
    assert np.exp(seq.log_tail[1]) == pytest.approx(1 - np.exp(-1.0) - np.exp(-2.0), rel=1e-5)
    masked = imported_sequence(
        {
            **GOOD,
            "target_mask": [[0, 0], [1, 1], [0, 0]],
            "target_logprobs": [[0, 0], [-2.0, -1.0], [-np.inf, -np.inf]],
        },
        0,
        vocab=10,
    )
    assert masked.row_mask.tolist() == [False, True, False]  # prompt positions: stored, not counted
    # stand-ins that decode
    assert masked.ids[2].tolist() == [0, 1] and np.isfinite(masked.logprobs).all()


@pytest.mark.parametrize(
    "edit, words",
    [
        (
            {"target_logprobs": [[-1, -1], [-2.0], [-0.5, -3.0]]},
            "target_logprobs: expected a [L][K] (K entries at every "
            "position) list of numbers, got ragged",
        ),
        ({"target_token_ids": [[0, 1], [3, 4]]}, "of one length L >= 1, got 3, (2, 2)"),
        (
            {"target_token_ids": [[0, 1], [3.5, 4], [5, 6]]},
            "target_token_ids: expected integer token ids, got fractional",
        ),
        (
            {"target_token_ids": None},
            "target_token_ids: expected a [L][K] (K entries at every position) list of "
            "numbers, got null",
        ),
        ({"input_ids": [5, -6, 7]}, "input_ids: expected ids in [0, 10), got range [-6, 7]"),
        ({"input_ids": [5, 6]}, "of one length"),
        ({"target_logprobs": [[0, 0], [2.0, -1.0], [-0.5, -3.0]]}, "expected log-probabilities"),
        (
            {"target_logprobs": [[0, 0], [-0.1, -0.2], [-0.5, -3.0]]},
            "expected top-K mass <= 1, got 1.7",
        ),
        ({"target_token_ids": [[0, 1], [3, 3], [5, 6]]}, "duplicates"),
        (
            {"target_token_ids": [[0, 1], [3, 40], [5, 6]]},
            "teacher_ids: expected values in [0, 10)",
        ),
        (
            {"target_mask": [[0, 0], [1, 0], [1, 1]]},
            "position 1: expected a target_mask of all 1 or all 0",
        ),
        # ids written as text: never read as numbers silently
        (
            {"target_token_ids": [["0", "1"], ["3", "4"], ["5", "6"]]},
            "target_token_ids: expected numbers, got text ('0'); the dataset was written with its "
            "numbers as strings: cast the column to integers",
        ),
        ({"input_ids": ["5", 6, 7]}, "input_ids: expected numbers, got text ('5')"),
        ({"target_logprobs": [[0, 0], ["-2.0", -1.0], [-0.5, -3.0]]}, "expected numbers, got text"),
    ],
)
def test_malformed_rows_are_refused_in_one_line_never_coerced(edit, words):
    with pytest.raises(ValueError) as refused:
        imported_sequence({**GOOD, **edit}, 4, vocab=10)
    message = str(refused.value)
    assert message.startswith("import: row 4") and words in message and "\n" not in message


def test_bad_flags_are_refused_before_anything_runs(built_cache, teacher_dir, tmp_path):
    assert (
        main(["cache", "export", built_cache, "--format", "parquet", "--out", str(tmp_path / "x")])
        == 2
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["cache", "export", built_cache, "--out", str(tmp_path / "full")]) == 2
    assert (
        main(
            [
                "cache",
                "import",
                str(tmp_path),
                "--tokenizer",
                teacher_dir,
                "--out",
                str(tmp_path / "y"),
            ]
        )
        == 2
    )


def test_a_dataset_written_one_position_shifted_is_refused():
    """Front-padded rows (row j = the distribution of token j) under Axolotl 0.18's pairing distil silently
    wrong; a teacher's top-1 gives it away: it is the current token, not the next one."""
    from topkd.cache.reading.interchange import check_alignment

    tokens = [5, 6, 7, 8, 9, 5, 6, 7]
    right = {
        "input_ids": tokens,
        "target_token_ids": [[t, 1] for t in tokens[1:]] + [[2, 3]],
        "target_logprobs": [[-0.1, -3.0]] * 8,
        "target_mask": [[1, 1]] * 8,
    }
    check_alignment([imported_sequence(right, 0, vocab=10)])
    shifted = {**right, "target_token_ids": [[t, 1 if t != 1 else 2] for t in tokens]}
    with pytest.raises(
        ValueError, match="top-1 is token j itself in 100% .*written one position shifted"
    ):
        check_alignment([imported_sequence(shifted, 0, vocab=10)])


def test_rows_padded_with_minus_inf_import_as_rows_of_variable_k(teacher_dir, tmp_path):
    """Axolotl pads a position's top-K with -inf (ids range(K), colliding with real ids): since the loss takes
    such padding, import writes it as cache format 4 instead of failing on the repeated id."""
    from transformers import AutoTokenizer

    from topkd.cache.building.teacher import fingerprint
    from topkd.cache.format.manifest import build_hash
    from topkd.cache.reading.interchange import _write_imported

    row = {
        "input_ids": [5, 6, 7],
        "target_token_ids": [[3, 3], [4, 0], [5, 6]],
        "target_logprobs": [[-1.0, -np.inf], [-0.5, -np.inf], [-0.5, -3.0]],
        "target_mask": [[1, 1]] * 3,
    }
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    fp = fingerprint(
        source="imported:x",
        weights_sha256="unknown",
        config_sha256="unknown",
        tokenizer=tok,
        dtype="unknown",
        vocab=1000,
        k=2,
        temperatures=(),
        engine="import axolotl",
    )
    build = {"data": [], "seq_len": 3, "codec": "rice-zstd", "separator": None, "tail": "unknown"}
    _write_imported(
        [imported_sequence(row, 0, vocab=1000)],
        str(tmp_path / "c"),
        fp,
        build,
        build_hash(fp, build),
        tok,
    )
    cache = TopKCache(str(tmp_path / "c"))
    got = cache[0]
    assert cache.manifest["format_version"] == 5 and cache.verify() == []
    assert (
        got["teacher_ids"][:2, 0].tolist() == [3, 4]
        and torch.isneginf(got["teacher_logprobs"][:2, 1]).all()
    )
