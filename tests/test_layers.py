"""docs/architecture.md's layer rules, enforced: no module imports a layer above its own."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).parents[1] / "src" / "topkd"
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
    if top == "base":  # src/topkd/base/: files, dist, memory, progress, signals, checks, stamp, ...
        return "base"
    return top if top in LAYERS else "app"


def imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    found |= {
        n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
    }
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


def module_graph() -> dict[str, set[str]]:
    """topkd module -> the topkd modules it imports, function-level imports included; `from pkg import sub` is an
    edge to the submodule, and a module's import of its own package's facade (__init__) is left out."""
    modules = {
        "topkd." + ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SRC.rglob("*.py")
    }
    graph = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                found |= subs or {node.module}
        facades = {
            m
            for m in found
            if modules.get(m, SRC).name == "__init__.py" and module.startswith(m + ".")
        }
        graph[module] = (found & modules.keys()) - facades - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_even_through_function_level_imports():
    assert cycles(module_graph()) == []
    # the check can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


def private_imports(path: pathlib.Path, packages: tuple[str, ...] = ("topkd",)) -> list[str]:
    """The names path imports from inside one of packages that are not exported (in a package's __all__, or a
    module that has one): `import topkd.x.y` counts as reaching inside."""
    import importlib
    import types

    def inside(module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages)

    private = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            private += [a.name for a in node.names if inside(a.name) and a.name != "topkd"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and inside(node.module or ""):
            module = importlib.import_module(node.module)
            for a in node.names:
                value = getattr(module, a.name, None)
                public = a.name in getattr(module, "__all__", ()) or (
                    isinstance(value, types.ModuleType) and hasattr(value, "__all__")
                )
                if not public:
                    private.append(f"{node.module}.{a.name}")
    return private


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_scripts_import_only_public_names(path):
    """benchmarks/ builds on topkd.bench and the packages' exported names (their __all__), never a module's inside:
    the package's internals can move without breaking the project's own scripts."""
    private = private_imports(path)
    assert not private, (
        f"{path.name} imports {private}: export them from topkd.bench (or the package's __all__)"
    )


@pytest.mark.parametrize("path", sorted((SRC / "bench").glob("*.py")), ids=lambda p: p.name)
def test_topkd_bench_times_the_loss_and_the_cache_through_their_public_names(path):
    """`topkd bench` measures what users call: topkd.loss, topkd.cache and the cache's format / building facades,
    never a module inside them (so a benchmark cannot time a path no user takes)."""
    private = private_imports(path, ("topkd.loss", "topkd.cache"))
    assert not private, f"bench/{path.name} imports {private}: use (or export) a public name"


def test_the_check_of_public_names_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from topkd.loss.fused import chunk_rows\nfrom topkd.loss import kd_loss\n")
    assert private_imports(probe, ("topkd.loss",)) == ["topkd.loss.fused.chunk_rows"]


CACHE_LAYERS = {"format": set(), "building": {"format"}, "reading": {"format", "building"}}


@pytest.mark.parametrize(
    "path", sorted((SRC / "cache").rglob("*.py")), ids=lambda p: str(p.relative_to(SRC))
)
def test_the_cache_folders_are_layers_too(path):
    """format (what is stored) <- building (teacher -> shards) <- reading (shards -> rows, verify, export)."""
    folder = path.relative_to(SRC / "cache").parts[0]
    if folder not in CACHE_LAYERS:  # topkd/cache/__init__.py: the facade over all three
        return
    allowed = CACHE_LAYERS[folder] | {folder}
    upward = sorted(
        m for m in imports(path) if m.startswith("topkd.cache.") and m.split(".")[2] not in allowed
    )
    assert not upward, f"cache/{folder}/{path.name} imports {upward}: see docs/architecture.md"


def test_the_package_never_imports_the_benchmark_scripts():
    def imports_benchmarks(path: pathlib.Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] == "benchmarks" for n in names):
                return True
        return False

    assert [p.name for p in SRC.rglob("*.py") if imports_benchmarks(p)] == []
    # it imports benchmarks.targets: the check can fail
    assert imports_benchmarks(BENCHMARKS / "gpu.py")


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_another_modules_private_names(path):
    """A leading underscore means "this module's own": another module (bench included) imports only the rest."""
    private = [
        f"{node.module}.{a.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("topkd")
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]
    assert not private, f"{path.relative_to(SRC)} imports {private}"


def _patches_at_import(tree: ast.Module) -> list[int]:
    """Lines where module-level code assigns to an attribute of another object (`other.NAME = ...`)."""
    assigns = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))]
    targets = [(n, t) for n in assigns for t in getattr(n, "targets", [getattr(n, "target", None)])]
    return [n.lineno for n, t in targets if isinstance(t, ast.Attribute)]


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_patches_another_when_imported(path):
    """Importing a module changes nothing elsewhere: a dependency is an import, never a global set from above."""
    lines = _patches_at_import(ast.parse(path.read_text()))
    assert not lines, (
        f"{path.relative_to(SRC)}:{lines} sets another module's attribute at import time"
    )


def test_the_patch_check_finds_one():
    tree = ast.parse("from topkd.data import dataset\ndataset.PATH_OPENER = object\nx = 1\n")
    assert _patches_at_import(tree) == [2]


def test_the_old_home_of_the_dataset_says_where_it_went():
    import topkd.data

    with pytest.raises(
        AttributeError, match=r"expected it in topkd.cache .*use `from topkd import TopKDataset`"
    ):
        topkd.data.TopKDataset
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        topkd.data.nothing
