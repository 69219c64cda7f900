"""Experiment configs: shipped files parse, overrides work, bad input fails early and clearly."""

import os
import pathlib
import subprocess
import sys

import pytest

from train.cli import main
from train.config import (ConfigError, DataConfig, ExperimentConfig, ModelConfig, apply_overrides, from_dict,
                          help_text, is_reference, load_config, to_dict)

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
    assert to_dict(c)["model"] == {"name": "gpt", "num_layers": 1}
    assert from_dict(None) == ExperimentConfig() and to_dict(ExperimentConfig())["task"] == "auto"


def test_sections_are_pydantic_models_with_validated_assignment():
    c = from_dict({"model": {"hidden": [32]}})
    assert c.data.model_dump()["batch_size"] == 128 and "task" in ExperimentConfig.model_json_schema()["properties"]
    c.optimizer.lr = "3e-4"  # YAML 1.1's float strings are numbers
    assert c.optimizer.lr == 3e-4
    with pytest.raises(ConfigError, match="optimizer.lr must be > 0, got -1"):
        c.optimizer.lr = -1
    with pytest.raises(ConfigError, match="unknown key 'model.hidden'"):
        c.model.name = "gpt"  # mlp's fields do not fit gpt
    assert c.model.name == "mlp" and c.optimizer.lr == 3e-4  # a failed assignment leaves the value as it was
    assert ExperimentConfig(model=ModelConfig(name="resnet", options={"width": 8})).model.options == {"width": 8}


@pytest.mark.parametrize("raw, message", [
    ({"optimizr": {}}, "unknown key 'optimizr'. Did you mean 'optimizer'?"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr must be a number, got 'fast'"),
    ({"steps": "10"}, "steps must be an integer, got '10'"),
    ({"steps": 0}, "steps must be >= 1, got 0"),
    ({"steps": True}, "steps must be an integer, got True"),
    ({"progress": 1}, "progress must be true/false, got 1"),
    ({"data": {"eval_batches": "all"}}, "data.eval_batches must be an integer or null, got 'all'"),
    ({"data": {"input_shape": [8, "x"]}}, "data.input_shape[1] must be an integer, got 'x'"),
    ({"data": {"val_fraction": 1}}, "data.val_fraction must be < 1, got 1"),
    ({"precision": {"allow": "exp"}}, "precision.allow must be a list, got 'exp'"),
    ({"model": {"name": "gpt", "layers": 2}}, "unknown key 'model.layers'. Did you mean 'model.num_layers'? "
                                              "Valid keys here: model.name, model.vocab_size"),
    ({"model": {"hidden": [64, "wide"]}}, "model.hidden[1] must be an integer, got 'wide'"),
    ({"model": {"dropout": "lots"}}, "model.dropout must be a number, got 'lots'"),
    ({"model": {"dtype": "int8"}}, "model.dtype: 'int8' is not a floating dtype"),
    ({"model": {"name": "vit"}}, "model.name: unknown model 'vit'. Valid: mlp, resnet, gpt, or a class reference "
                                 "package.module:Name / path/to/file.py:Name"),
    ({"model": {"name": "mpl"}}, "model.name: unknown model 'mpl'. Did you mean 'mlp'? Valid: mlp, resnet, gpt, or"),
    ({"model": {"name": "pkg.mod:"}}, "model.name: 'pkg.mod:' is not a class reference of the form"),
    ({"model": {"name": 3}}, "model.name must be a string, got 3"),
    ({"data": {"name": "cifar10"}}, "data.name: unknown dataset 'cifar10'. Valid: digits, fashion_mnist"),
    ({"data": {"name": "digit"}}, "Did you mean 'digits'?"),
    ({"data": {"name": "loaders:make data"}}, "data.name: 'loaders:make data' is not a function reference"),
    ({"data": {"options": {"n": 1}}}, "data.options: only a user data function"),
    ({"data": {"name": "m:f", "options": [1]}}, "data.options must be a mapping, got [1]"),
    ({"task": "regression"}, "task: unknown task 'regression'. Valid: auto, classification, lm, language_model, or a "
                             "loss function reference module:function / path/to/file.py:function"),
    ({"task": "clasification"}, "Did you mean 'classification'?"),
    ({"task": "losses.py:"}, "task: 'losses.py:' is not a loss function reference"),
    ({"data": {"batchsize": 3}}, "unknown key 'data.batchsize'. Did you mean 'data.batch_size'? Valid keys here: "
                                 "data.name, data.options, data.path"),
    ({"distributed": {"num_processes": 2, "process_id": 2}}, "distributed.process_id must be < distributed."),
    ({"precision": {"policy": "p=f32,c=f17"}}, "precision.policy: Invalid precision policy 'p=f32,c=f17': "
                                               "unknown dtype 'f17' at position 8. Did you mean 'f16'?"),
    ({"precision": {"rules": [["LayerNorm", "f33"]]}}, "precision.rules: rules[0] ('LayerNorm')"),
    ({"precision": {"loss_scale": "dynamc"}}, "precision.loss_scale: unknown value 'dynamc'; valid: auto, none"),
    ({"precision": {"loss_scale": "dynamic", "growth_factor": 0.5}}, "growth_factor must be a number > 1"),
    ({"optimizer": {"name": "adagard"}}, "optimizer.name: unknown optimizer 'adagard'. Did you mean 'adagrad'? Valid: "
                                         "adam, adamw, sgd, lion, an optax optimizer ("),
    ({"inference_dtypes": ["float8"]}, "inference_dtypes[0]: unknown value 'float8'; valid: float16, bfloat16"),
    ({"data": 3}, "data must be a mapping"),
    (3, "the config must be a mapping"),
])
def test_bad_configs_name_the_key_and_the_valid_choices(raw, message):
    with pytest.raises(ConfigError) as info:
        from_dict(raw)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name, ok", [
    ("pkg.models:Net", True), ("models:Net", True), ("my_models.py:Net", True), ("path/to/file.py:Net", True),
    ("../x y/m.py:_Net2", True), ("pkg.models:", False), (":Net", False), ("pkg..models:Net", False),
    ("pkg.models:Net.Inner", False), ("pkg-x:Net", False), (".py:Net", False), ("m:class", False), ("nonsense", False)])
def test_reference_syntax(name, ok):
    assert is_reference(name) is ok
    for raw, get, key in [({"model": {"name": name}}, lambda c: c.model.name, "model.name"),
                          ({"data": {"name": name}}, lambda c: c.data.name, "data.name"),
                          ({"task": name}, lambda c: c.task, "task")]:
        if ok:
            assert get(from_dict(raw)) == name
        else:
            with pytest.raises(ConfigError, match=f"^{key}: "):
                from_dict(raw)


def test_a_user_model_takes_any_options_and_a_user_data_function_its_options():
    c = from_dict({"model": {"name": "my_models.py:Net", "features": {"depth": 3, "act": "gelu"}, "widths": [8, 4],
                             "rate": "1e-3"},
                   "data": {"name": "my_data:load", "options": {"n": 100, "split": {"val": 0.1}}},
                   "task": "my_losses:xent"})
    assert c.model.options == {"features": {"depth": 3, "act": "gelu"}, "widths": [8, 4], "rate": "1e-3"}
    assert c.data.options == {"n": 100, "split": {"val": 0.1}} and c.task == "my_losses:xent"
    assert to_dict(c)["model"] == {"name": "my_models.py:Net", **c.model.options} and from_dict(to_dict(c)) == c
    c = load_config(ROOT / "configs" / "default.yaml", ["model.name=pkg.nets:Net", "model.block.depth=2",
                                                        "data.name=pkg.data:load", "data.options.n=5", "task=lm"])
    # another model.name replaces the file's model: its hidden (the built-in MLP's) is dropped
    assert c.model.options == {"block": {"depth": 2}} and c.data.options == {"n": 5}
    assert from_dict({"task": "language_model"}).task == "lm" and DataConfig().options == {}
    assert from_dict({"model": {"name": "mlp", "options": {"hidden": [3]}}}).model.options == {"hidden": [3]}


@pytest.mark.parametrize("override, message", [
    ("steps", "not of the form key=value"),
    ("optimizer=3", "'optimizer' is a section"),
    ("steps.x=3", "'steps' is a value, not a section"),
    ("optimizer.lr=[1", "not valid YAML"),
    ("stepz=3", "unknown key 'stepz'. Did you mean 'steps'?"),
    ("optimizr.lr=3", "unknown key 'optimizr'. Did you mean 'optimizer'? Valid keys here: seed, workdir"),
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


def test_unknown_keys_get_the_nearest_key_of_their_own_level():
    for raw, message in [({"optimizr": {"lr": 1}}, "unknown key 'optimizr'. Did you mean 'optimizer'?"),
                         ({"optimizer": {"lrr": 1}}, "unknown key 'optimizer.lrr'. Did you mean 'optimizer.lr'?"),
                         ({"model": {"hiden": [1]}}, "unknown key 'model.hiden'. Did you mean 'model.hidden'?")]:
        with pytest.raises(ConfigError) as info:
            from_dict(raw)
        assert str(info.value).startswith(message)
    with pytest.raises(ConfigError) as info:
        from_dict(apply_overrides({}, ["optimizer.lrr=1"]))
    assert "Valid keys here: optimizer.name, optimizer.lr," in str(info.value) and "optimizr" not in str(info.value)


def test_help_lists_every_section_and_model_field(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for field in ("steps", "workdir", "data.batch_size", "optimizer.lr", "precision.policy",
                  "precision.loss_scale", "num_layers", "stage_sizes", "task", "data.options", "mapping",
                  "package.module:Name / path/to/file.py:Name", "module:function / path/to/file.py:function"):
        assert field in text
    assert help_text() in text
    for line in help_text().splitlines():
        if line.startswith("  data.options"):
            assert line.split()[1:4] == ["mapping", "default", "{}"] and "user data function" in line


def test_print_config_shows_the_resolved_config(capsys):
    assert main([str(ROOT / "configs" / "default.yaml"), "--print-config", "steps=5", "task=language_model"]) == 0
    out = capsys.readouterr().out
    assert "steps: 5" in out and "task: lm" in out and "  hidden:" in out


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
        assert proc.stderr.count("\n") == 1  # one line
        assert message in " ".join(proc.stderr.split())
        assert proc.stdout == ""
    assert not os.path.exists(workdir)


def test_the_config_reference_page_matches_the_code():
    page = (ROOT / "docs" / "config.md").read_text()
    assert help_text() in page, "docs/config.md is stale: regenerate it from train.config.help_text()"


def test_a_model_name_on_the_command_line_replaces_the_files_model():
    """The file's other model keys were written for the file's model: another model.name drops them,
    while model.* overrides given with it apply; the same name keeps them."""
    mlp = str(ROOT / "examples" / "user_models" / "nnx_mlp.py") + ":MLP"
    assert load_config(ROOT / "configs" / "default.yaml", [f"model.name={mlp}"]).model.options == {}
    given = load_config(ROOT / "configs" / "default.yaml",
                        ["model.hidden=64", f"model.name={mlp}", "model.in_features=64"])
    assert given.model.options == {"hidden": 64, "in_features": 64}
    assert load_config(ROOT / "configs" / "default.yaml", ["model.name=mlp"]).model.options["hidden"] == [256, 256]


@pytest.mark.parametrize("where", ["file", "command line"])
def test_a_model_argument_the_model_does_not_take_names_its_value_and_where_it_came_from(tmp_path, where):
    from train import build_experiment

    mlp = str(ROOT / "examples" / "user_models" / "nnx_mlp.py") + ":MLP"
    config = tmp_path / "c.yaml"
    widths = "  widths: [256, 256]\n" if where == "file" else ""
    config.write_text(f"model:\n  name: {mlp}\n  in_features: 64\n{widths}")
    overrides = ["model.widths=[256, 256]"] if where == "command line" else []
    origin = str(config) if where == "file" else "the command line"
    with pytest.raises(ConfigError, match=rf"model.widths: MLP takes no argument 'widths'.* \(model.widths=\[256, "
                                          rf"256\] \(from {origin}\)\)"):
        build_experiment(load_config(config, overrides))


def test_the_readme_example_of_mixed_bf16_on_the_default_config_needs_no_loss_scale():
    """Issue 39 (15): the default config pinned a dynamic loss scale, so the README's
    `precision.policy=mixed_bf16` kept scaling the loss; it ships `auto`."""
    import precision
    from train.config import build_loss_scale

    bf16 = load_config(ROOT / "configs" / "default.yaml", ["precision.policy=mixed_bf16"])
    assert isinstance(build_loss_scale(bf16.precision), precision.NoOpLossScale)
    f16 = load_config(ROOT / "configs" / "default.yaml")
    assert isinstance(build_loss_scale(f16.precision), precision.DynamicLossScale)


def test_the_default_experiments_time_is_one_figure_everywhere():
    import re

    quoted = {path: re.findall(r"about (\d+) s on 2 CPU cores", (ROOT / path).read_text())
              for path in ("README.md", "configs/default.yaml")}
    assert len({tuple(v) for v in quoted.values()}) == 1 and all(quoted.values()), quoted
    assert "reaches 99.33% test accuracy in\n9 s" in (ROOT / "docs" / "experiments.md").read_text()
