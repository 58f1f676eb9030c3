"""docs/architecture.md's layer rules, enforced: no module imports a layer above its own."""
import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).parents[1] / "src" / "topkd"
BASE = {"files", "memory", "stamp", "progress", "signals", "checks", "dist", "tiles", "trace", "rows", "version"}
LAYERS = {  # layer -> the layers it may import (base is always allowed)
    "data": set(),
    "loss": set(),
    "models": set(),
    "cache": {"data", "models"},
    "train": {"data", "loss", "cache", "models"},
    "eval": {"data", "loss", "cache", "models"},
}


def layer_of(module: str) -> str:
    """topkd.<x>... -> x's layer: "base", a package of LAYERS, or "app" (bench, demo, cli: may import anything)."""
    if module == "topkd":  # the package facade re-exports the loss: an application of it
        return "app"
    top = module.split(".")[1]
    if top in BASE:
        return "base"
    return top if top in LAYERS else "app"


def imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    found |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    return {m for m in found if m == "topkd" or m.startswith("topkd.")}


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_a_layer_above_its_own(path):
    module = "topkd." + ".".join(path.relative_to(SRC).with_suffix("").parts)
    mine = layer_of(module.removesuffix(".__init__"))
    if mine == "app":
        return
    allowed = {"base", mine} | LAYERS.get(mine, set())
    upward = sorted(m for m in imports(path) if layer_of(m) not in allowed and m != "topkd")
    assert not upward, f"{module} ({mine}) imports {upward}: see docs/architecture.md"
