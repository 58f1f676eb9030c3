"""topkd.bench.common: the per-point process runner (a hang, a crash or a chatty process is a row, not a stop)."""

import os


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
    assert run_json_lines([sys.executable, "-c", chatty], ["a"], 30.0, dict(os.environ)) == {
        "a": {"status": "ok"}
    }


def test_each_line_reaches_on_row_while_the_process_still_runs(tmp_path):
    """A caller that writes each row in on_row keeps it even when the process then hangs and is killed."""
    import sys

    from topkd.bench.common import run_json_lines

    pid_file = tmp_path / "pid"
    hang = (
        f"import json, os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        "print(json.dumps({'status': 'ok'}), flush=True); time.sleep(60)"
    )
    seen = []

    def on_row(key, row):
        os.kill(int(pid_file.read_text()), 0)  # raises if the process had already ended
        seen.append((key, row))

    rows = run_json_lines(
        [sys.executable, "-c", hang], ["a", "b"], 3.0, dict(os.environ), on_row=on_row
    )
    assert seen == [("a", {"status": "ok"})] and rows["b"]["status"] == "timeout"
