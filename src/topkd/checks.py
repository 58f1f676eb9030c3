"""Small config checks shared by the command-line jobs (cache build, train)."""
from __future__ import annotations


def require_ints(cfg, names: tuple[str, ...], minimum: int) -> None:
    """Each named field of cfg must be an int >= minimum; the message names the flag."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
