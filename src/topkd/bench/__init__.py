"""topkd.bench: benchmarks that print ratios measured in one run (`topkd bench loss | train | cache | model`).

The names below are what the project's own scripts in benchmarks/ build on (tests/test_layers.py holds them to
these and to the other packages' public names): a measurement in a fresh process, the results table, the plots,
the teacher rows and kernel switch of a loss point, the cost model's prediction, result stamps, and what the
on-policy and served-teacher benchmarks time (a run and its step, generation, a teacher in memory or served).

    from topkd.bench import run_json_lines, results_table, Column, predict_point, H200
"""

from topkd.base.files import write_json_atomic
from topkd.base.stamp import stamp
from topkd.bench.common import (
    Column,
    out_of_memory,
    plot_vs_length,
    results_table,
    run_json_lines,
    series_by_impl,
    skipped_after_oom,
)
from topkd.bench.model import H200, fused_kernels, predict_point
from topkd.bench.point import peer_problem, teacher_rows
from topkd.cache.building import ServedTeacher, load_teacher
from topkd.data.documents import Sequence
from topkd.models.generate import generate
from topkd.train.loop import train_step
from topkd.train.on_policy import completion_item
from topkd.train.run import open_run

__all__ = [
    "Column",
    "H200",
    "Sequence",
    "ServedTeacher",
    "completion_item",
    "fused_kernels",
    "generate",
    "load_teacher",
    "open_run",
    "out_of_memory",
    "peer_problem",
    "plot_vs_length",
    "predict_point",
    "results_table",
    "run_json_lines",
    "series_by_impl",
    "skipped_after_oom",
    "stamp",
    "teacher_rows",
    "train_step",
    "write_json_atomic",
]
