"""Every package the library imports is one ``pip install .`` installs, or an extra's
(``export`` once needed safetensors, which only the Hugging Face extra brought in)."""

import ast
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: import name -> distribution name, where they differ
DISTRIBUTIONS = {"sklearn": "scikit-learn", "orbax": "orbax-checkpoint", "yaml": "pyyaml", "pydantic_core": "pydantic"}
#: imported only where the extra is asked for (a config's tracker, a Hugging Face model), with a one-line error
EXTRAS = {"transformers": "hf", "wandb": "wandb"}


def _imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name not in ("train", "precision")}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_package_the_library_imports_is_a_dependency_or_an_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core, extras = _names(project["dependencies"]), project["optional-dependencies"]
    missing = []
    for name in sorted(_imports("train") | _imports("precision")):
        if name in EXTRAS:
            if name not in _names(extras[EXTRAS[name]]):
                missing.append(f"{name} (extra {EXTRAS[name]})")
        elif DISTRIBUTIONS.get(name, name).lower() not in core:
            missing.append(name)
    assert not missing, f"imported but not installed by pip install .: {', '.join(missing)}"
