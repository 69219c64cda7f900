"""User models, data and losses named by reference: found, built, checked
against each other before compute, and every bad reference one clear line."""

import textwrap
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from train import ConfigError, DataError, UserCodeError, UserData, get_task
from train.experiment.builders import build_data, build_model, check_model_fits_data
from train.data import load_dataset
from train.data.user import from_user_function
from train.references import resolve

MODELS_PY = '''
import dataclasses
import flax.linen as nn
from flax import nnx

@dataclasses.dataclass
class Config:
    width: int = 16
    depth: int = 1

class LinenNet(nn.Module):
    config: Config
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for _ in range(self.config.depth):
            x = nn.relu(nn.Dense(self.config.width)(x))
        return nn.Dense(self.num_classes)(x)

class NNXNet(nnx.Module):
    def __init__(self, in_features, num_classes, *, rngs):
        self.out = nnx.Linear(in_features, num_classes, rngs=rngs)

    def __call__(self, x):
        return self.out(x.reshape(x.shape[0], -1))

def not_a_model():
    return 3

BROKEN = 1
'''

DATA_PY = '''
import numpy as np

def arrays(n=40):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return {"train": {"inputs": x, "labels": y, "weight": np.ones(n, np.float32)},
            "test": {"inputs": x[:10], "labels": y[:10], "weight": np.ones(10, np.float32)}}

class Source:
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return {"inputs": np.full((3,), i, np.float32), "labels": np.int32(i % 2)}

def sources():
    return {"train": Source(20), "eval": Source(5), "num_classes": 2}

def weighted_loss(outputs, batch):
    per = (outputs[:, 0] - batch["labels"]) ** 2 * batch["weight"]
    return per.mean(), {"abs_error": abs(outputs[:, 0] - batch["labels"]).mean()}

def bad_loss(outputs, batch):
    return outputs
'''


@pytest.fixture
def user_files(tmp_path):
    (tmp_path / "my_models.py").write_text(textwrap.dedent(MODELS_PY))
    (tmp_path / "my_data.py").write_text(textwrap.dedent(DATA_PY))
    return tmp_path


def _model(name, **options):
    return SimpleNamespace(name=name, options=options)


def test_models_from_files_take_config_dataclasses_and_data_defaults(user_files):
    digits = load_dataset("digits")
    linen = build_model(_model(f"{user_files}/my_models.py:LinenNet", config={"width": 8, "depth": 2}), digits)
    assert linen.config.width == 8 and linen.num_classes == 10  # num_classes from the data
    check_model_fits_data(linen, digits)
    nnx_model = build_model(_model(f"{user_files}/my_models.py:NNXNet", in_features=64), digits, seed=3)
    check_model_fits_data(nnx_model, digits)


@pytest.mark.parametrize("name,options,message", [
    ("{d}/missing.py:Net", {}, r"model.name: file .*missing.py not found"),
    ("{d}/my_models.py:LinenNte", {}, r"model.name: .*my_models.py has no attribute 'LinenNte'. Did you mean 'LinenNet'\?"),
    ("no_such_package.models:Net", {}, r"model.name: no module named 'no_such_package'"),
    ("{d}/my_models.py:BROKEN", {}, r"model.name: .*BROKEN is a int, not a model class"),
    ("{d}/my_models.py:not_a_model", {}, r"model.name: .*not_a_model gave a int, not a flax"),
    ("{d}/my_models.py:LinenNet", {"config": {"widht": 3}}, r"model.config.widht: Config has no field 'widht'. Did you mean 'model.config.width'\?"),
    ("{d}/my_models.py:LinenNet", {"config": {}, "hidden": 3}, r"model.hidden: LinenNet takes no argument 'hidden'"),
    ("{d}/my_models.py:NNXNet", {}, r"model.in_features: NNXNet needs argument 'in_features'"),
    ("{d}/my_models.py:LinenNet", {"config": {}, "num_classes": 3}, r"outputs logits of shape \(3,\) .* needs \(10,\)"),
    ("{d}/my_models.py:NNXNet", {"in_features": 5}, r"model '.*NNXNet' cannot take digits inputs of shape \(8, 8\)"),
])
def test_every_bad_model_reference_is_one_line_naming_the_key(user_files, name, options, message):
    digits = load_dataset("digits")
    with pytest.raises(ConfigError, match=message) as info:
        model = build_model(_model(name.format(d=user_files), **options), digits)
        check_model_fits_data(model, digits, name.format(d=user_files))
    assert "\n" not in str(info.value)


def test_user_arrays_and_sources_batch_shuffle_and_resume_like_ours(user_files):
    data = build_data(SimpleNamespace(name=f"{user_files}/my_data.py:arrays", options={"n": 40}), seed=0)
    assert isinstance(data, UserData) and data.task == "classification" and data.num_classes == 2
    assert data.input_shape == (6,)
    epoch = [data.train_batch(i, 8, seed=0) for i in range(5)]
    seen = np.concatenate([b["inputs"][:, 0] for b in epoch])
    assert len(np.unique(seen)) == 40  # one epoch: every example once
    again = data.train_batch(3, 8, seed=0, rows=slice(4, 8))  # a pure function of (seed, index): resumable
    np.testing.assert_array_equal(again["inputs"], epoch[3]["inputs"][4:8])
    assert not np.array_equal(data.train_batch(5, 8, 0)["inputs"], epoch[0]["inputs"])  # epoch 2 reshuffled
    eval_batches = list(data.eval_batches(4))
    assert [b["mask"].sum() for b in eval_batches] == [4, 4, 2] and set(eval_batches[0]) >= {"weight", "mask"}

    source = build_data(SimpleNamespace(name=f"{user_files}/my_data.py:sources", options={}), seed=0)
    batch = source.train_batch(0, 4, seed=0)
    assert batch["inputs"].shape == (4, 3) and source.num_classes == 2
    assert sorted(np.concatenate([source.train_batch(i, 4, 0)["inputs"][:, 0] for i in range(5)])) == list(range(20))


def test_a_user_loss_trains_and_evaluates_per_example(user_files):
    data = build_data(SimpleNamespace(name=f"{user_files}/my_data.py:arrays", options={}), seed=0)
    task = get_task(f"{user_files}/my_data.py:weighted_loss")
    outputs = np.ones((4, 2), np.float16)  # a half-precision output reaches the loss in float32
    batch = data.train_batch(0, 4, 0)
    loss, metrics = task.loss(outputs, batch)
    assert loss.dtype == np.float32 and set(metrics) == {"abs_error"}
    padded = next(data.eval_batches(16, 1)) | {"mask": np.arange(16) < 3}
    sums = task.eval_sums(np.zeros((16, 2), np.float32), padded)
    assert float(sums["count"]) == 3  # padding rows never count
    expected = sum(float(padded["labels"][i]) ** 2 for i in range(3))
    np.testing.assert_allclose(sums["loss_sum"], expected, rtol=1e-6)


@pytest.mark.parametrize("spec,message", [
    ("regression", r"task: unknown task 'regression'; valid: auto, classification"),
    ("{d}/my_data.py:nope", r"task: .*my_data.py has no attribute 'nope'"),
    ("{d}/my_data.py:bad_loss", r"task: .*bad_loss must return \(loss, metrics dict\)"),
])
def test_bad_tasks_name_the_key(user_files, spec, message):
    with pytest.raises(UserCodeError, match=message):
        task = get_task(spec.format(d=user_files), "classification")
        jax.eval_shape(task.loss, np.zeros((2, 2), np.float32), {"labels": np.zeros(2, np.int32)})


@pytest.mark.parametrize("name,message", [
    ("{d}/my_data.py:missing", r"data.name: .*has no attribute 'missing'"),
    ("{d}/nothing.py:load", r"data.name: file .*nothing.py not found"),
])
def test_bad_data_references_name_the_key(user_files, name, message):
    with pytest.raises(DataError, match=message):
        build_data(SimpleNamespace(name=name.format(d=user_files), options={}), seed=0)


def test_bad_user_data_says_what_is_expected():
    with pytest.raises(DataError, match="returned no eval split"):
        from_user_function(lambda: {"train": {"inputs": np.zeros((4, 2))}}, {})
    with pytest.raises(DataError, match="one row per example"):
        UserData("bad", {"inputs": np.zeros((4, 2)), "labels": np.zeros(3)}, {"inputs": np.zeros((2, 2))})
    class Source:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"inputs": np.zeros(2, np.float32), "labels": np.int32(i % 2)}

    with pytest.raises(DataError, match="give num_classes with a classification source"):
        UserData("bad", Source(), Source())
    with pytest.raises(DataError, match="need an 'inputs' entry"):
        UserData("bad", {"x": np.zeros((4, 2))}, {"x": np.zeros((2, 2))})


def test_module_references_import_like_python():
    assert resolve("train.data:load_dataset", "data.name") is load_dataset
    with pytest.raises(UserCodeError, match="is not a reference"):
        resolve("just_a_name", "model.name")


def test_a_user_loss_may_not_shadow_the_step_metrics():
    task = get_task(f"{__file__}:_shadowing_loss")
    with pytest.raises(UserCodeError, match=r"returns metrics named \['grad_norm'\]"):
        task.loss(np.zeros((2, 2), np.float32), {})


def _shadowing_loss(outputs, batch):
    return outputs.mean(), {"grad_norm": outputs.mean()}
