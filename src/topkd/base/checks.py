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


def require_writable(flag: str, path: str) -> None:
    """An output file the job writes at its end (its missing folders are made then): checked before the work,
    so that a long run never ends in a bare errno."""
    if os.path.isdir(path):
        raise ValueError(
            f"{flag}: expected a file to write, got {path!r}, a directory; name a file in it"
        )
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(
        parent
    ):  # the nearest folder that exists is where the missing ones will be made
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        what = "a directory" if os.path.isdir(parent) else "a file"
        raise ValueError(
            f"{flag}: expected a path this user can write, got {path!r}, under {parent!r}, {what} it cannot "
            "write into; choose another path"
        )


def require_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected {' | '.join(DTYPES)}, got {dtype!r}")


def require_ints(cfg, names: tuple[str, ...], minimum: int) -> None:
    """Each named field of cfg must be an int >= minimum; the message names the flag."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
