"""Installing topkd where users are: ranges in pyproject.toml, exact pins only in the test environments' files.

    python -m pytest tests/test_install.py      # also run by `make test-compat` on Python 3.12

The dry run asks pip what `pip install -e .` would do in the environment running the suite (the user's torch,
transformers and numpy already installed): it must install none of them.
"""

import json
import os
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_STACK = {"torch", "transformers", "numpy"}


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    deps = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(d) for d in deps]


def _pins(name: str) -> dict[str, Version]:
    pins = {}
    for line in open(os.path.join(ROOT, "constraints", name)):
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            pins[req.name.lower().replace("_", "-")] = Version(
                str(req.specifier).removeprefix("==")
            )
    return pins


def _lower_bound(req: Requirement) -> Version:
    bounds = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert len(bounds) == 1, f"{req}: expected one '>=' lower bound"
    return bounds[0]


def test_the_library_declares_ranges_not_pins():
    for req in _requirements() + [
        r for e in ("dev", "triton", "eval", "hf") for r in _requirements(e)
    ]:
        assert all(s.operator == ">=" for s in req.specifier), (
            f"{req}: a library declares ranges, not pins"
        )


def test_the_oldest_environment_pins_every_dependency_at_its_lower_bound():
    oldest = _pins("oldest.txt")
    for req in _requirements() + _requirements("dev"):
        assert oldest[req.name] == _lower_bound(req) or req.name in ("pytest", "ruff"), (
            f"{req}: constraints/oldest.txt has {oldest[req.name]}, not the declared lower bound"
        )


@pytest.mark.parametrize("lock", ["test.txt", "oldest.txt"])
def test_each_lock_satisfies_the_declared_ranges(lock):
    pins = _pins(lock)
    for req in (
        _requirements() + _requirements("dev") + (_requirements("hf") if lock == "test.txt" else [])
    ):
        assert req.specifier.contains(pins[req.name], prereleases=True), (
            f"{lock}: {req.name} {pins[req.name]}"
        )


def test_installing_keeps_the_torch_transformers_and_numpy_already_installed(tmp_path):
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}  # what a user's pip sees
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--disable-pip-version-check",
            "--report",
            str(report),
            "-e",
            ROOT,
        ],
        check=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    would_install = {
        item["metadata"]["name"].lower() for item in json.load(open(report))["install"]
    }
    assert not would_install & USER_STACK, f"pip would replace {sorted(would_install & USER_STACK)}"
    assert "topkd" in would_install
