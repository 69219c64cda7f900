"""``key=null`` unsets a key a config file sets (its default applies, or for the
optimizer fields passed on only when set: not passed), the way a user swaps the
shipped config's adamw for a factory that takes no weight decay; a key whose null
is a value of its own keeps it; a required key refuses null in one line."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from pydantic import ValidationError

from docs_pages import ROOT
from train import ConfigError, build_optimizer, load_config
from train.cli import main
from train.config.errors import error_message
from train.config.section import Section

DEFAULT = ROOT / "configs" / "default.yaml"
PARAMS = {"w": jnp.arange(12.0).reshape(4, 3) / 10 - 0.5, "b": jnp.ones(3)}
GRADS = jax.tree_util.tree_map(lambda p: 0.5 * p + 0.1, PARAMS)
FACTORY = """
import optax

def make(learning_rate):
    return optax.sgd(learning_rate)
"""


def _first_update(tx):
    return tx.update(GRADS, tx.init(PARAMS), PARAMS)[0]


def test_null_unsets_the_shipped_weight_decay_of_a_builtin():
    shipped = load_config(DEFAULT, ["optimizer.warmup_steps=0"]).optimizer  # a first step of lr > 0
    unset = load_config(DEFAULT, ["optimizer.warmup_steps=0", "optimizer.weight_decay=null"]).optimizer
    assert shipped.weight_decay == 1e-4 and unset.weight_decay == 0.0  # the field's default: no decay
    assert "weight_decay" not in unset.model_fields_set
    schedule = build_optimizer(unset, 1500)[1]
    reference = optax.adamw(schedule, weight_decay=0.0)
    chex.assert_trees_all_close(_first_update(build_optimizer(unset, 1500)[0]), _first_update(reference))
    assert not jnp.allclose(_first_update(build_optimizer(shipped, 1500)[0])["w"], _first_update(reference)["w"])


def test_a_user_factory_without_weight_decay_runs_the_shipped_config_once_it_is_unset(tmp_path, capsys):
    (tmp_path / "opt.py").write_text(FACTORY)
    swap = [f"optimizer.name={tmp_path}/opt.py:make", f"workdir={tmp_path}/run"]
    assert main([str(DEFAULT), *swap, "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {DEFAULT}: optimizer.weight_decay: {tmp_path}/opt.py:make takes no argument")
    assert "takes no argument 'weight_decay'" in err and "optimizer.weight_decay=null" in err
    assert "\n" not in err and "Traceback" not in err
    assert main([str(DEFAULT), *swap, "optimizer.weight_decay=null", "--check"]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    config = load_config(DEFAULT, [*swap, "optimizer.weight_decay=null"])
    tx, _ = build_optimizer(config.optimizer, 1500)
    chex.assert_trees_all_close(_first_update(tx), _first_update(optax.sgd(build_optimizer(config.optimizer,
                                                                                            1500)[1])))


def test_null_gives_any_key_its_default_and_a_nullable_key_keeps_null():
    config = load_config(DEFAULT, ["steps=null", "model.hidden=null", "precision.initial_scale=null",
                                   "compile_cache=null", "data.eval_batches=null", "precision.fp8=null"])
    assert config.steps == 1000 and config.precision.initial_scale == 2.0 ** 15  # the schema's defaults
    assert "hidden" not in config.model.options  # the model's own default: (256, 256)
    assert config.compile_cache is None and config.data.eval_batches is None  # null is their "off" / "all"
    assert config.precision.fp8.scaling == "current"


def test_null_inside_a_value_and_a_required_key_are_refused_in_one_line():
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, ["model.hidden=[64, null]"])
    assert str(info.value) == ("the command line (model.hidden=[64, null]): model.hidden[1] must be an integer, "
                               "got None")

    class Required(Section):
        width: int

    with pytest.raises(ValidationError) as info:
        Required.model_validate({"width": None})
    assert error_message(info.value.errors()[0], Required, ("demo",)) == (
        "demo.width is required and cannot be null (unset); it must be an integer")


def _keys(schema=None, prefix=""):
    """Every key of the config schema, dotted (``workdir``, ``precision.fp8.scaling``...)."""
    from pydantic import BaseModel

    from train.config import ExperimentConfig

    for name, field in (schema or ExperimentConfig).model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from _keys(kind, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_an_empty_value_on_the_command_line_is_refused_for_every_key_naming_it_and_the_empty_variable():
    """``workdir=`` (``workdir=$RUN`` with RUN unset) ran in runs/default, resuming whatever was there."""
    keys = list(_keys()) + ["model.hidden"]
    assert len(keys) > 60 and "workdir" in keys and "precision.fp8.scaling" in keys
    for key in keys:
        with pytest.raises(ConfigError) as info:
            load_config(DEFAULT, [f"{key}=", "workdir=elsewhere"] if key != "workdir" else ["workdir= "])
        message = str(info.value)
        assert f"{key} has an empty value (an empty shell variable, as in {key}=$RUN?)" in message, message
        assert f"{key}=null to unset it" in message and "\n" not in message
    assert load_config(DEFAULT, ["workdir=null"]).workdir == "runs/default"  # null still unsets


def test_the_cli_refuses_an_empty_workdir_in_one_line_before_touching_runs_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([str(DEFAULT), "workdir=", "steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: the command line (workdir=): workdir has an empty value (an empty shell variable, as in "
                   "workdir=$RUN?): give it a value, or workdir=null to unset it")
    assert not (tmp_path / "runs").exists()
    for key in ("data.path", "compile_cache"):  # a path written empty on purpose: refused too
        with pytest.raises(ConfigError, match=f"{key} must not be empty"):
            load_config(DEFAULT, [f'{key}=""'])
