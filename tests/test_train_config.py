"""Experiment configs: shipped files parse, overrides work, bad input fails early and clearly."""

import os
import pathlib
import subprocess
import sys

import pytest

from train.cli import main
from train.config import ConfigError, apply_overrides, from_dict, help_text, load_config, to_dict

ROOT = pathlib.Path(__file__).parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def test_the_shipped_configs_are_there_and_valid():
    names = {p.stem for p in SHIPPED}
    assert {"default", "fmnist_resnet_fp32", "fmnist_resnet_mixed_bf16", "fmnist_resnet_mixed_f16",
            "shakespeare_gpt_fp32", "shakespeare_gpt_mixed_bf16", "shakespeare_gpt_mixed_f16"} <= names
    for path in SHIPPED:
        config = load_config(path)
        assert config.workdir.endswith(path.stem) or path.stem == "default"


def test_overrides_are_dotted_typed_and_reach_every_section():
    c = load_config(ROOT / "configs" / "default.yaml",
                    ["steps=7", "workdir=/tmp/x", "optimizer.lr=3e-4", "precision.policy=mixed_bf16",
                     "model.hidden=[64, 32]", "data.eval_batches=null", "progress=false"])
    assert (c.steps, c.workdir, c.optimizer.lr, c.precision.policy) == (7, "/tmp/x", 3e-4, "mixed_bf16")
    assert c.model.options["hidden"] == [64, 32] and c.data.eval_batches is None and c.progress is False


def test_to_dict_round_trips():
    c = from_dict({"model": {"name": "gpt", "num_layers": 1}, "optimizer": {"lr": "1e-3"}})
    assert from_dict(to_dict(c)) == c and c.optimizer.lr == 1e-3


@pytest.mark.parametrize("raw, message", [
    ({"optimizr": {}}, "unknown key 'optimizr'. Did you mean 'optimizer'?"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr must be a number, got 'fast'"),
    ({"steps": "10"}, "steps must be an integer, got '10'"),
    ({"steps": 0}, "steps must be >= 1, got 0"),
    ({"model": {"name": "gpt", "layers": 2}}, "unknown key 'model.layers'. Did you mean 'model.num_layers'?"),
    ({"model": {"name": "vit"}}, "unknown model 'vit'; valid: mlp, resnet, gpt"),
    ({"data": {"name": "cifar10"}}, "unknown dataset 'cifar10'; valid: digits, fashion_mnist"),
    ({"precision": {"policy": "p=f32,c=f17"}}, "precision.policy: Invalid precision policy 'p=f32,c=f17': "
                                               "unknown dtype 'f17' at position 8. Did you mean 'f16'?"),
    ({"precision": {"rules": [["LayerNorm", "f33"]]}}, "precision.rules: rules[0] ('LayerNorm')"),
    ({"precision": {"loss_scale": "dynamc"}}, "precision.loss_scale: unknown value 'dynamc'; valid: auto, none"),
    ({"precision": {"loss_scale": "dynamic", "growth_factor": 0.5}}, "growth_factor must be a number > 1"),
    ({"optimizer": {"name": "adagrad"}}, "optimizer.name: unknown value 'adagrad'; valid: adam, adamw, sgd, lion"),
    ({"inference_dtypes": ["float8"]}, "inference_dtypes: unknown dtype 'float8'"),
    ({"data": 3}, "data must be a mapping"),
])
def test_bad_configs_name_the_key_and_the_valid_choices(raw, message):
    with pytest.raises(ConfigError) as info:
        from_dict(raw)
    assert message in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("steps", "not of the form key=value"),
    ("optimizer=3", "'optimizer' is a section"),
    ("steps.x=3", "'steps' is a value, not a section"),
    ("optimizer.lr=[1", "not valid YAML"),
    ("stepz=3", "Did you mean 'steps'?"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("?", r"\?")):
        apply_overrides({}, [override])


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml not found. Shipped configs in .*default.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML at line \d"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)
    typo = tmp_path / "typo.yaml"
    typo.write_text("optimizer:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: unknown key 'optimizer.lrr'. Did you mean 'optimizer.lr'\?"):
        load_config(typo)


def test_help_lists_every_section_and_model_field(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for field in ("steps", "workdir", "data.batch_size", "optimizer.lr", "precision.policy",
                  "precision.loss_scale", "num_layers", "stage_sizes"):
        assert field in text
    assert help_text() in text


def test_print_config_shows_the_resolved_config(capsys):
    assert main([str(ROOT / "configs" / "default.yaml"), "--print-config", "steps=5"]) == 0
    assert "steps: 5" in capsys.readouterr().out


def test_cli_errors_are_one_paragraph_without_traceback_and_before_compute(tmp_path):
    workdir = tmp_path / "never"
    for args, message in (
        (["configs/default.yaml", "precision.policy=p=f32,c=f17", f"workdir={workdir}"], "unknown dtype 'f17'"),
        (["configs/default.yaml", "optimizer.lr=fast"], "optimizer.lr must be a number"),
        (["configs/nope.yaml"], "configs/nope.yaml not found"),
        (["configs/default.yaml", "data.name=fashion_mnist", f"data.path={tmp_path}", f"workdir={workdir}"],
         "Fashion-MNIST files not found"),
    ):
        proc = subprocess.run([sys.executable, "-m", "train", *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: ")
        assert message in " ".join(proc.stderr.split())
        assert proc.stdout == ""
    assert not os.path.exists(workdir)


def test_the_config_reference_page_matches_the_code():
    page = (ROOT / "docs" / "config.md").read_text()
    assert help_text() in page, "docs/config.md is stale: regenerate it from train.config.help_text()"
