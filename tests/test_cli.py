"""The command line as a user meets it: one-line refusals (exit 2, traceback only with --debug), nothing left
behind by a refused start, --version, plain progress lines off a terminal, signals and a full disk mid-build."""

import hashlib
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import topkd

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def topkd_cli(*args, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "topkd.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env or ENV,
        **kw,
    )


def _digests(root) -> dict:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "shards").glob("*"))
    }


def test_no_pickle_and_no_remote_code_anywhere_in_the_package():
    """Files a user is handed (caches, checkpoints, models) are read without running code from them."""
    src = os.path.join(os.path.dirname(topkd.__file__))
    for root, _, files in os.walk(src):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(root, name)).read()
                assert "trust_remote_code=True" not in text and "weights_only=False" not in text, (
                    name
                )
                assert "pickle.load(" not in text and "pickle.loads(" not in text, name


def test_version():
    res = topkd_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"topkd {topkd.__version__}"


@pytest.mark.parametrize(
    "args,match",
    [
        (
            ["train", "--cache", "nope", "--out", "OUT", "--init-from-teacher", "--layers", "1"],
            "--cache: expected an existing directory",
        ),
        (
            [
                "train",
                "--cache",
                "CACHE",
                "--out",
                "OUT",
                "--init-from-teacher",
                "--layers",
                "1",
                "--device",
                "cuda",
            ],
            "device: cuda was asked for",
        ),
        (
            ["cache", "build", "--teacher", "nope", "--data", "TEXT", "--out", "OUT"],
            "never fetches from a hub",
        ),
        (
            [
                "cache",
                "build",
                "--teacher",
                "TEACHER",
                "--data",
                "TEXT",
                "--out",
                "OUT",
                "--seq-len",
                "4096",
            ],
            "at most the teacher's 512 positions",
        ),
        (
            [
                "cache",
                "build",
                "--teacher",
                "NOTOK",
                "--data",
                "TEXT",
                "--out",
                "OUT",
                "--seq-len",
                "48",
            ],
            "expected tokenizer files",
        ),
        (
            [
                "cache",
                "build",
                "--teacher",
                "TEACHER",
                "--data",
                "EMPTY",
                "--out",
                "OUT",
                "--seq-len",
                "48",
            ],
            "got no tokens",
        ),
        (["cache", "verify", "OUT"], "not a directory"),
        (
            [
                "train",
                "--cache",
                "CACHE",
                "--out",
                "OUT",
                "--init-from-teacher",
                "--layers",
                "1",
                "--divergence",
                "kld",
            ],
            "divergence: expected one of",
        ),
        (
            [
                "train",
                "--cache",
                "CACHE",
                "--out",
                "OUT",
                "--init-from-teacher",
                "--layers",
                "1",
                "--divergence",
                "jsd",
                "--beta",
                "1.5",
            ],
            "beta",
        ),
        (
            ["eval", "--model", "TEACHER", "--text", "nope.txt"],
            "--text/--choices/--prompts: expected an existing file",
        ),
        (
            ["eval", "--model", "TEACHER", "--text", "TEXT", "--seq-len", "1"],
            "seq_len: expected an integer >= 2",
        ),
    ],
)
def test_refusals_are_one_line_and_leave_nothing_behind(
    built_cache, teacher_dir, text_file, tmp_path, args, match
):
    import shutil

    notok = shutil.copytree(
        teacher_dir, tmp_path / "notok", ignore=shutil.ignore_patterns("tokenizer*")
    )
    (tmp_path / "empty.txt").write_text("")
    subst = {
        "OUT": tmp_path / "out",
        "CACHE": built_cache,
        "TEACHER": teacher_dir,
        "TEXT": text_file,
        "NOTOK": notok,
        "EMPTY": tmp_path / "empty.txt",
    }
    res = topkd_cli(*[subst.get(a, a) for a in args])
    assert res.returncode == 2, res.stderr[-1500:]
    lines = [
        line for line in res.stderr.splitlines() if line.strip() and "Loading weights" not in line
    ]
    assert (
        len(lines) == 1
        and lines[0].startswith(
            f"topkd {' '.join(args[:2]) if args[0] == 'cache' else args[0]}: error: "
        )
        and match in lines[0]
    ), res.stderr[-1500:]
    assert not (tmp_path / "out").exists()


def test_debug_shows_the_traceback_instead(tmp_path):
    res = topkd_cli("cache", "verify", tmp_path / "nope", "--debug")
    assert res.returncode != 0 and "Traceback" in res.stderr and "CacheError" in res.stderr


def test_bad_data_is_named_with_file_position_and_remedy(teacher_dir, tmp_path):
    bad_ids = tmp_path / "ids.npy"
    np.save(bad_ids, np.array([[1, 2, 3], [4, 1000, 5]]))
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"first line\nsecond caf\xe9 line\n")
    field = tmp_path / "f.jsonl"
    field.write_text('{"text": "fine"}\n{"text": 7}\n')
    for path, match in (
        (
            bad_ids,
            "ids.npy: token id 1000 at position (1, 1) is outside the teacher's vocabulary "
            "[0, 1000)",
        ),
        (latin, "latin.txt:2: expected UTF-8 text, got an invalid byte at offset 21"),
        (field, "f.jsonl:2: expected an object with a string field 'text'"),
    ):
        res = topkd_cli(
            "cache",
            "build",
            "--teacher",
            teacher_dir,
            "--data",
            path,
            "--out",
            tmp_path / "out",
            "--seq-len",
            "48",
        )
        assert res.returncode == 2 and match in res.stderr, res.stderr[-1000:]
        assert not (tmp_path / "out").exists()


def test_progress_lines_off_a_terminal_and_a_last_line_saying_what_was_written(
    teacher_dir, text_file, tmp_path
):
    env = {**ENV, "TQDM_DISABLE": "", "TOPKD_PROGRESS_SECONDS": "0"}
    res = topkd_cli(
        "cache",
        "build",
        "--teacher",
        teacher_dir,
        "--data",
        text_file,
        "--out",
        tmp_path / "c",
        "--seq-len",
        "48",
        "--targets",
        "topk",
        "--k",
        "4",
        "--seqs-per-shard",
        "8",
        env=env,
    )
    assert res.returncode == 0, res.stderr[-1000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("cache build:")]
    assert lines and "\r" not in res.stderr.split("Loading weights")[-1].split("\n", 1)[-1]
    assert "/1,774 tok" in lines[-1] and "(100%)" in lines[-1] and "ETA" in lines[0]
    assert (
        res.stdout.strip()
        .splitlines()[-1]
        .startswith("cache build: wrote 5 shards, 37 sequences, 1,774 tokens")
    )


@pytest.fixture(scope="module")
def long_text(tmp_path_factory):
    from tests.cache.tiny import make_text

    path = tmp_path_factory.mktemp("long") / "long.txt"
    path.write_text(make_text(20000, seed=3))
    return str(path)


def _build_args(teacher_dir, data, out):
    return [
        "cache",
        "build",
        "--teacher",
        teacher_dir,
        "--data",
        data,
        "--out",
        out,
        "--seq-len",
        "32",
        "--targets",
        "topk",
        "--k",
        "8",
        "--seqs-per-shard",
        "1",
    ]


@pytest.mark.once
def test_sigterm_during_a_build_drops_the_shard_in_flight_and_the_rerun_completes(
    teacher_dir, long_text, tmp_path
):
    out = tmp_path / "c"
    proc = subprocess.Popen(
        [sys.executable, "-m", "topkd.cli", *_build_args(teacher_dir, long_text, out)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "shards").glob("*.json"))) < 5:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-1500:]
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("topkd cache build: stopped by SIGTERM: the shard in flight was dropped")
    )
    assert not list((out / "shards").glob("*.tmp-*")) and not (out / "manifest.json").exists()
    assert topkd_cli(*_build_args(teacher_dir, long_text, out)).returncode == 0
    assert topkd_cli(*_build_args(teacher_dir, long_text, tmp_path / "ref")).returncode == 0
    assert _digests(out) == _digests(tmp_path / "ref")


@pytest.mark.once
def test_a_full_disk_mid_build_is_one_line_and_the_rerun_completes(
    teacher_dir, long_text, tmp_path
):
    """RLIMIT_FSIZE makes the kernel refuse writes past 4 KB per file with EFBIG, as a full disk refuses them."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))

    out = tmp_path / "c"
    # 8 sequences per shard: ~5 KB shards
    args = _build_args(teacher_dir, long_text, out)[:-1] + ["8"]
    res = subprocess.run(
        [sys.executable, "-m", "topkd.cli", *args, "--max-sequences", "40"],
        env=ENV,
        capture_output=True,
        text=True,
        preexec_fn=limit,
    )
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith(
        "topkd cache build: error: [Errno 27] File too large"
    )
    assert not list((out / "shards").glob("*.tmp-*"))
    assert topkd_cli(*args, "--max-sequences", "40").returncode == 0
    assert (
        topkd_cli(
            *_build_args(teacher_dir, long_text, tmp_path / "ref")[:-1] + ["8"],
            "--max-sequences",
            "40",
        ).returncode
        == 0
    )
    assert _digests(out) == _digests(tmp_path / "ref")


def test_every_command_declares_its_flags_one_way():
    """One table of commands; every flag of every command is a field of its config dataclass with a help line."""
    import dataclasses

    from topkd.cli import COMMANDS, build_parser

    parser = build_parser()
    for cmd in COMMANDS:
        assert set(cmd.flag_help) == {f.name for f in dataclasses.fields(cmd.config)}, cmd.words
        positional = [
            f.name for f in dataclasses.fields(cmd.config) if f.metadata.get("positional")
        ]
        args = parser.parse_args([*cmd.words, *("x" for _ in positional)])
        assert args.which is cmd
    args = parser.parse_args(["cache", "inspect", "runs/c", "--plot", "m.png"])
    assert (args.path, args.plot) == ("runs/c", "m.png")


@pytest.mark.parametrize(
    "argv, guess",
    [
        (["train", "--stepz", "3"], "--steps"),
        (["train", "--step", "3"], "--steps"),
        (["cache", "build", "--seq_len", "8"], "--seq-len"),
    ],
)
def test_unknown_or_abbreviated_flags_name_the_command_and_the_nearest_flag(argv, guess, capsys):
    """argparse answered with the top-level usage, and took --step for --steps silently."""
    from topkd.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    name = " ".join(argv[:2] if argv[0] == "cache" else argv[:1])
    assert (
        len(err) == 1
        and err[0].startswith(f"topkd {name}: error: ")
        and f"did you mean {guess}?" in err[0]
    )


def test_help_shows_a_default_only_where_there_is_one_and_once():
    from topkd.cli import COMMANDS, build_parser

    parser = build_parser()
    for cmd in COMMANDS:
        sub = parser._subparsers._group_actions[0].choices[cmd.words[0]]
        if len(cmd.words) == 2:
            sub = sub._subparsers._group_actions[0].choices[cmd.words[1]]
        text = " ".join(sub.format_help().split())
        assert "(default: )" not in text, cmd.words
        for action in sub._actions:
            assert (action.help or "").count("(default") <= 1, (cmd.words, action.dest)
