"""A config's names are resolved once, in one place (train.experiment.names), and the
builders read what they stand for: the user's code is imported once per run, and a
builder given resolved names never looks a name up again."""

from pathlib import Path

import optax
import pytest

from train import ConfigError, DataError, load_config
from train.experiment import names as names_lib
from train.experiment.builders import experiment_from, train_state_from
from train.experiment.loop import check_experiment
from train.experiment.names import resolve_names, resolve_optimizer, resolve_schedule, resolve_task

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "user_models"
CUSTOM = EXAMPLES / "custom_data.yaml"


def _config(tmp_path, *overrides):
    return load_config(CUSTOM, [*overrides, f"workdir={tmp_path}"])


def test_every_name_of_a_config_resolves_to_what_it_names(tmp_path):
    config = _config(tmp_path, "optimizer.name=lamb", "optimizer.schedule=warmup_cosine_decay_schedule",
                     "optimizer.options={}")
    names = resolve_names(config)
    assert names.model.target.__name__ == "MLP" and not names.model.builtin
    assert names.data.target.__name__ == "load_digits_split"
    assert names.task.target.__name__ == "smoothed_cross_entropy"
    assert names.optimizer.target is optax.lamb and names.optimizer.label == "optax.lamb"
    assert names.schedule.target is optax.warmup_cosine_decay_schedule
    assert resolve_optimizer("adamw").builtin and resolve_optimizer("adamw").target is None
    assert resolve_schedule("cosine").label == "cosine"
    assert resolve_task("auto").builtin and resolve_task("lm").name == "lm"


def test_a_run_imports_each_reference_once(tmp_path, monkeypatch):
    """check_experiment builds data, task, model and the train state (abstractly): each of
    the config's three references is looked up once, whatever reads it."""
    looked_up = []
    real = names_lib.resolve
    monkeypatch.setattr(names_lib, "resolve", lambda ref, key: looked_up.append(key) or real(ref, key))
    check_experiment(_config(tmp_path, "steps=2"))
    assert sorted(looked_up) == ["data.name", "model.name", "task"]


def test_builders_read_the_resolved_names_not_the_config_names(tmp_path):
    """Given names that stand for something else than the config's text, the builders build
    what the names stand for: nothing past the resolution reads a name."""
    config = _config(tmp_path, "steps=2", "optimizer.name=lamb")
    names = resolve_names(config)
    mlp, built = names.model.target, []

    def other_model(in_features, num_classes, *, rngs):
        built.append({"in_features": in_features, "num_classes": num_classes})
        return mlp(in_features, num_classes, rngs=rngs)

    def other_optimizer(learning_rate):
        built.append("optimizer")
        return optax.sgd(learning_rate)

    names = names._replace(model=names.model._replace(target=other_model),
                           optimizer=names.optimizer._replace(target=other_optimizer))
    data, task, model = experiment_from(names, config)
    assert built[0]["in_features"] == 64 and built[0]["num_classes"] == 10 and type(model).__name__ == "MLP"
    state, _ = train_state_from(names, config, model, data)
    assert built[-1] == "optimizer" and task.name.endswith("smoothed_cross_entropy")


@pytest.mark.parametrize("override,error,message", [
    ("data.name=my_data.py:nothing", DataError, "data.name: .*my_data.py has no attribute 'nothing'"),
    ("task=my_data.py:EVAL_FRACTION_NOT_THERE", ConfigError, "task: .*has no attribute"),
    ("model.name=nnx_mlp.py:nnx", ConfigError, "model.name: .*nnx_mlp.py:nnx is a module, not a model class"),
])
def test_a_name_that_does_not_resolve_is_one_line_naming_its_key(tmp_path, override, error, message):
    with pytest.raises(error, match=message) as info:
        resolve_names(_config(tmp_path, override))
    assert "\n" not in str(info.value)


def test_an_unknown_task_given_to_the_python_api_names_the_valid_ones():
    with pytest.raises(ConfigError, match="task: unknown task 'regression'; valid: auto, classification"):
        resolve_task("regression")
