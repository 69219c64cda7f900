"""Runs jmp's own test files, from the installed jmp wheel, with ``precision``
standing in for jmp. Used by ``test_jmp_suite.py`` in a subprocess.

    python tests/jmp_suite_runner.py OUT.json

Before jmp's tests are imported, ``sys.modules`` gets modules named ``jmp``,
``jmp._src``, ``jmp._src.policy`` and ``jmp._src.loss_scale`` that hold nothing
but precision's own objects under jmp's names; jmp's code is never imported.
The test files are loaded by path and run with unittest. Writes
``{"results": {test id: outcome}, ...}``, an outcome being ``passed``,
``skipped: reason`` or ``failed: ExceptionType: first line``.
"""

import importlib.metadata
import importlib.util
import json
import sys
import types
import unittest
from pathlib import Path

TEST_FILES = ("policy_test.py", "loss_scale_test.py")

# jmp name -> precision object, per jmp module.
POLICY_NAMES = ("Policy", "get_policy", "parse_dtype", "half_dtype", "cast_to_full", "cast_to_half",
                "dtype_to_names")
LOSS_SCALE_NAMES = ("NoOpLossScale", "StaticLossScale", "DynamicLossScale", "LossScale", "all_finite",
                    "select_tree")


def installed_jmp_tests() -> tuple[str, list[Path]]:
    """The installed jmp's version and test files, found without importing jmp."""
    spec = importlib.util.find_spec("jmp")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("jmp is not installed")
    package = Path(list(spec.submodule_search_locations)[0])
    version = "unknown"
    for dist in importlib.metadata.distributions(name="jmp"):  # noqa: B007 - the installed one
        version = dist.version
    return version, [package / "_src" / name for name in TEST_FILES]


def install_shim() -> dict[str, types.ModuleType]:
    import precision
    import precision.loss_scale
    import precision.policy

    def module(name, source, names):
        m = types.ModuleType(name, f"precision standing in for {name}")
        for n in names:
            setattr(m, n, getattr(source, n))
        return m

    policy = module("jmp._src.policy", precision.policy, POLICY_NAMES)
    loss_scale = module("jmp._src.loss_scale", precision.loss_scale, LOSS_SCALE_NAMES)
    src = types.ModuleType("jmp._src")
    src.__path__ = []  # a package whose only submodules are the two above
    src.policy, src.loss_scale = policy, loss_scale
    top = module("jmp", precision, POLICY_NAMES[:-1] + LOSS_SCALE_NAMES)
    top.__path__ = []
    top._src = src
    top.__version__ = f"precision {precision.__version__}"
    shim = {"jmp": top, "jmp._src": src, "jmp._src.policy": policy, "jmp._src.loss_scale": loss_scale}
    sys.modules.update(shim)
    return shim


class Recorder(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcomes: dict[str, str] = {}

    @staticmethod
    def _name(test) -> str:
        return test.id()

    def addSuccess(self, test):
        self.outcomes[self._name(test)] = "passed"

    def _failed(self, test, err):
        kind, value, _ = err
        first = (str(value).strip().splitlines() or [""])[0][:300]
        self.outcomes[self._name(test)] = f"failed: {kind.__name__}: {first}"

    addFailure = addError = _failed

    def addSkip(self, test, reason):
        self.outcomes[self._name(test)] = f"skipped: {reason}"

    def addExpectedFailure(self, test, err):
        self.outcomes[self._name(test)] = "passed"

    def addUnexpectedSuccess(self, test):
        self.outcomes[self._name(test)] = "failed: unexpected success"


def main(out: str) -> None:
    version, files = installed_jmp_tests()
    shim = install_shim()
    import precision

    recorder = Recorder()
    for path in files:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
        # jmp's tests must see precision's objects, not jmp's.
        assert mod.jmp is shim["jmp._src." + path.stem.removesuffix("_test")], path
        unittest.defaultTestLoader.loadTestsFromModule(mod).run(recorder)
    real_jmp_loaded = any(getattr(m, "__file__", None) and "site-packages" in str(m.__file__)
                          and name.split(".")[0] == "jmp" for name, m in list(sys.modules.items()))
    Path(out).write_text(json.dumps({
        "jmp_version": version,
        "files": [str(f) for f in files],
        "real_jmp_loaded": real_jmp_loaded,
        "policy_is_ours": shim["jmp"].Policy is precision.Policy,
        "results": recorder.outcomes,
    }, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
