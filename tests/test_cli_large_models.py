"""A model too large to compile (a 2,000-layer MLP: XLA's compile memory grows until
an allocation fails and the process aborts, minutes in) is refused before anything
compiles, in one line naming the limit and how to lift it (exit 2)."""

from docs_pages import ROOT
from train.experiment import fits as builders
from train.cli import main

DEFAULT = ROOT / "configs" / "default.yaml"


def test_the_reported_2000_layer_mlp_is_past_the_limit():
    arrays = 2000 * 4 + 2  # per layer a Dense kernel and bias, a LayerNorm scale and bias; the output Dense
    assert builders.LARGE_PROGRAM_ARRAYS < builders.MAX_PROGRAM_ARRAYS < arrays


def test_too_many_param_arrays_fail_before_compiling_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MP_MAX_PARAM_ARRAYS", "40")  # the default limit, scaled down: 10 layers have 42 arrays
    run = [str(DEFAULT), "model.hidden=[8, 8, 8, 8, 8, 8, 8, 8, 8, 8]", f"workdir={tmp_path}/run"]
    assert main(run) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the command line (model.hidden=[8, 8, 8, 8, 8, 8, 8, 8, 8, 8]): model 'mlp' has "
                          "42 param arrays in 21 modules, more than the 40 a program is limited to: XLA's compile "
                          "time and memory grow")
    assert err.endswith("or raise the limit with MP_MAX_PARAM_ARRAYS=42") and "\n" not in err
    assert not (tmp_path / "run").exists()  # refused before anything ran
    monkeypatch.setenv("MP_MAX_PARAM_ARRAYS", "42")
    assert main([*run, "--check"]) == 0
    monkeypatch.setenv("MP_MAX_PARAM_ARRAYS", "lots")
    assert main([*run, "--check"]) == 2
    assert "MP_MAX_PARAM_ARRAYS must be a number of param arrays, got 'lots'" in capsys.readouterr().err
