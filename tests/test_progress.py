"""Progress off a terminal: a line on time from a timer (not only when a unit of work ends), skipped work out of
the rate, train's line showing the step it counts, the build counting teacher batches as they finish."""

import re
import time

from topkd.base.progress import PlainProgress, skipped


def test_a_line_comes_on_time_while_one_unit_of_work_runs_long(monkeypatch, capsys):
    """A 17-minute build printed nothing for 13 minutes: lines came only when a shard ended."""
    monkeypatch.setenv("TOPKD_PROGRESS_SECONDS", "0.2")
    bar = PlainProgress(total=10, desc="work", unit="it")
    bar.update(1)
    time.sleep(1.1)  # one long unit of work: no update() call in between
    lines = capsys.readouterr().err.splitlines()
    bar.close()
    assert len(lines) >= 3 and all(line.startswith("work: 1/10 it (10%)") for line in lines)


def test_skipped_work_is_counted_but_not_in_the_rate(monkeypatch):
    """A resumed build found 90% done: the ETA of the 10% left must come from this run's own rate."""
    monkeypatch.setenv("TOPKD_PROGRESS_SECONDS", "0")
    bar = PlainProgress(total=1000, desc="build", unit="tok", silent=True)
    skipped(bar, 900)
    bar.start -= 10.0  # ten seconds of this run's work for the next 50 tokens
    bar.update(50)
    line = bar.line()
    rate = float(re.search(r", ([\d.]+) tok/s", line).group(1))
    assert "950/1,000 tok (95%)" in line and 4.9 < rate < 5.1 and "ETA 10s" in line


def test_train_progress_shows_the_loss_of_the_step_it_counts(
    built_cache, tmp_path, monkeypatch, capfd
):
    """Two "40/40" lines with different losses: set_postfix came after the update that printed."""
    from tests.train.runs import config, losses
    from topkd.train import train

    monkeypatch.setenv("TQDM_DISABLE", "")
    monkeypatch.setenv("TOPKD_PROGRESS_SECONDS", "0")
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    train(config(built_cache, tmp_path, steps=3))
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("train:")]
    shown = [float(re.search(r"loss=([\d.]+)", line).group(1)) for line in lines[:3]]
    assert [line.split(" step")[0] for line in lines[:3]] == [
        "train: 1/3",
        "train: 2/3",
        "train: 3/3",
    ]
    assert shown == [round(x, 4) for x in losses(tmp_path)]


def test_the_build_counts_teacher_batches_as_they_finish(
    teacher_dir, text_file, tmp_path, monkeypatch, capfd
):
    from tests.conftest import cache_config
    from topkd.cache import build

    monkeypatch.setenv("TQDM_DISABLE", "")
    monkeypatch.setenv("TOPKD_PROGRESS_SECONDS", "0")
    build(
        cache_config(
            teacher_dir, text_file, tmp_path / "c", max_sequences=8, seqs_per_shard=8, batch_size=2
        )
    )
    counts = [int(m.group(1)) for m in re.finditer(r"cache build: (\d+)/", capfd.readouterr().err)]
    # one line per batch of 2 x 48 tokens, all in one shard
    assert counts[:4] == [96, 192, 288, 384]


def test_counts_read_as_a_person_writes_them():
    from topkd.base.progress import count

    assert (count(1, "shard"), count(5, "shard"), count(1774, "token")) == (
        "1 shard",
        "5 shards",
        "1,774 tokens",
    )


def test_a_bar_left_unclosed_by_an_error_stops_printing(monkeypatch, capsys):
    """A build that raised mid-way left its timer printing into every later line of the process (a notebook,
    the test suite): the users close their bars in finally, and a dropped bar's timer stops by itself."""
    import gc

    from topkd.base.progress import track

    monkeypatch.setenv("TOPKD_PROGRESS_SECONDS", "0.1")
    try:
        for _ in track(range(5), desc="doomed"):
            raise RuntimeError("mid-way")
    except RuntimeError:
        pass
    bar = PlainProgress(total=3, desc="dropped", unit="it")
    bar.update(1)
    del bar
    gc.collect()
    time.sleep(1.3)
    capsys.readouterr()
    time.sleep(1.3)
    assert capsys.readouterr().err == ""
