"""The layout stays readable: no import circles in the packages, old import paths
of public names keep working, and no file or function grows past what one reads at once."""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("precision", "train")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports, at any depth (a function's lazy import too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    graph = {_module_name(p): _imports(p, modules) for p in files}
    # A package's __init__ re-exports its modules; importing a module runs its parents' __init__
    # first, which is not a dependency of the module on them.
    return {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _circles(_graph()) == []


#: train's packages (and top modules), bottom up: each imports only :mod:`precision` and the ones
#: before it (docs/design.md). Models know nothing of precision; precision knows nothing of train.
LAYERS = ("train.models", "train.references", "train.parallel", "train.data", "train.finetune", "train.config",
          "train.weights", "train.training", "train.tracking", "train.experiment", "train.inspections", "train.serving", "train.cli", "train.__main__")


def _layer(module: str) -> str:
    """``train.training.step`` -> ``train.training``; ``precision.autocast.x`` -> ``precision``;
    ``train`` (its ``__init__``, the public API) -> ``train``."""
    parts = module.split(".")
    return parts[0] if parts[0] == "precision" or len(parts) == 1 else ".".join(parts[:2])


def test_the_packages_follow_the_layers():
    assert set(LAYERS) == {_layer(m) for m in _graph() if m.startswith("train.")}, "a package without a layer"
    wrong = []
    for module, targets in _graph().items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if here == "precision":
                allowed = there == "precision"
            elif here == "train.models":
                allowed = there == "train.models"
            elif here == "train":
                allowed = True
            else:
                allowed = there == "precision" or LAYERS.index(there) <= LAYERS.index(here)
            if not allowed:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_train_has_few_modules_at_its_top():
    top = [p.name for p in (ROOT / "train").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
    assert len(top) <= 15, sorted(top)


def test_old_module_paths_of_train_warn_and_give_the_moved_module():
    import warnings

    import train
    from train.training import step

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("train.step")
    assert old is step and any("train.step moved to train.training.step" in str(w.message) for w in caught)
    assert callable(train.compile_for)  # the function, not the module it moved out of


def test_the_circle_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("old, names", [
    ("precision.op_lists", ["ALLOW", "DENY", "OpLists", "op_lists"]),
    ("precision.regions", ["compute_in"]),
    ("precision.transform", ["autocast"]),
    ("precision.program", ["iter_ops", "matmul_ops"]),
    ("precision.fused_attention", ["marking"]),
])
def test_old_import_paths_of_public_names_keep_working(old, names):
    module = importlib.import_module(old)
    new = importlib.import_module(old.replace("precision.", "precision.autocast."))
    assert module is new
    for name in names:
        assert getattr(module, name) is getattr(new, name)


def test_the_public_names_are_where_they_were():
    import precision

    assert callable(precision.autocast) and callable(precision.op_lists) and callable(precision.explain)
    from precision import fused_attention  # noqa: F401  (a module, as before)
    from precision.autocast import interpreter  # the package's modules, by their new path

    assert interpreter.evaluate


def test_files_and_functions_stay_readable():
    """No file over 400 lines and no function over 80 in the packages: past that, one
    file or function usually holds two ideas."""
    long = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if len(text.splitlines()) > 400:
                long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.end_lineno - node.lineno + 1 > 80:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                                    f"{node.end_lineno - node.lineno + 1} lines")
    assert long == []
