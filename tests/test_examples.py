"""The README's example trains, and reports bad input without a traceback."""

import pathlib
import runpy
import subprocess
import sys


EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "mixed_f16_digits.py"


def test_example_trains_in_mixed_f16():
    main = runpy.run_path(str(EXAMPLE))["main"]
    assert main(["--steps", "150"]) > 0.9


def test_example_rejects_a_bad_policy_with_one_clear_line():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--policy", "p=f32,c=f17", "--steps", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "unknown dtype 'f17' at position 8. Did you mean 'f16'?" in proc.stderr
