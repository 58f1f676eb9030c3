"""`topkd demo`: the whole pipeline on one machine (run.py), its chat step (chat.py), and its report and plot
(report.py)."""

from topkd.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
