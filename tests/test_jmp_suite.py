"""jmp's own test suite, from the installed jmp wheel, run against precision.

The README promises that jmp code runs with ``import precision as jmp``. Here
jmp's ``policy_test.py`` and ``loss_scale_test.py`` (97 tests in jmp 0.0.4) run
in a subprocess in which the modules ``jmp``, ``jmp._src.policy`` and
``jmp._src.loss_scale`` hold only precision's objects (``jmp_suite_runner.py``).
Everything passes except the differences below, which are by design.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, subprocess_env

pytest.importorskip("jmp")
pytest.importorskip("absl.testing.parameterized")  # jmp's tests are absl tests (absl-py comes with chex)

#: jmp test -> why precision differs on purpose.
BY_DESIGN = {
    "loss_scale_test.LossScaleTest.test_static_empty_trees_NoOpLossScale":
        "every loss scale carries state leaves: skipped_steps and nonfinite_streak counters",
    "loss_scale_test.LossScaleTest.test_static_empty_trees_StaticLossScale":
        "every loss scale carries state leaves: skipped_steps and nonfinite_streak counters",
    "loss_scale_test.LossScaleTest.test_dynamic_loss_scale_tree":
        "DynamicLossScale's leaves also hold min/max scale, hysteresis and the counters, so they survive jit",
    "loss_scale_test.LossScaleTest.test_dynamic_loss_scale_raises_type_error_on_int_loss_scale":
        "an integer loss scale is converted to float32, without jmp's warning",
    "loss_scale_test.LossScaleTest.test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale":
        "an integer min_loss_scale is converted to float32, without jmp's warning",
}
JMP_0_0_4_TESTS = 97
MIN_PASSED = 92


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("jmp_suite") / "results.json"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("jmp_suite_runner.py")), str(out)],
                          env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_jmps_suite_runs_against_precision_not_jmp(suite):
    assert suite["policy_is_ours"] and not suite["real_jmp_loaded"]
    assert all(Path(f).is_file() for f in suite["files"])
    if suite["jmp_version"] == "0.0.4":
        assert len(suite["results"]) == JMP_0_0_4_TESTS, sorted(suite["results"])


def test_jmps_suite_passes_but_for_the_differences_by_design(suite):
    results = suite["results"]
    ok = {name for name, outcome in results.items() if outcome == "passed" or outcome.startswith("skipped")}
    failed = {name: outcome for name, outcome in results.items() if name not in ok}
    unexpected = {name: outcome for name, outcome in failed.items() if name not in BY_DESIGN}
    assert not unexpected, json.dumps(unexpected, indent=1)
    assert len(ok) >= len(results) - len(BY_DESIGN)
    if suite["jmp_version"] == "0.0.4":
        assert len(ok) >= MIN_PASSED
        # The list stays honest: a difference that went away is taken off it.
        assert set(failed) == set(BY_DESIGN), sorted(set(BY_DESIGN) - set(failed))
