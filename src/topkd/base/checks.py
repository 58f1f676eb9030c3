"""Small config checks shared by the command-line jobs (cache build, train, eval), run before any model loads."""

from __future__ import annotations

import os

import torch

DTYPES = ("float32", "bfloat16", "float16")


def require_device(device: str) -> None:
    """cpu, or cuda where this torch sees a GPU: refused before any model is loaded."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected cpu | cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device: cuda was asked for, but this torch sees no GPU (torch.cuda.is_available() is "
            "False); use --device cpu, or install a CUDA build of torch"
        )


def require_path(flag: str, path: str, kind: str = "any") -> None:
    """An input path that must exist (kind: any | dir | file), named by its flag."""
    ok = {"any": os.path.exists, "dir": os.path.isdir, "file": os.path.isfile}[kind](path)
    if not ok:
        what = {
            "any": "an existing path",
            "dir": "an existing directory",
            "file": "an existing file",
        }[kind]
        raise ValueError(f"{flag}: expected {what}, got {path!r} (not found); check the path")


def require_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected {' | '.join(DTYPES)}, got {dtype!r}")


def require_ints(cfg, names: tuple[str, ...], minimum: int) -> None:
    """Each named field of cfg must be an int >= minimum; the message names the flag."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
