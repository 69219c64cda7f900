"""A dict of inputs passed as the model takes it (issue 67, item 1): keyword arguments where
its keys are parameters of the model's ``__call__``, the dict whole where the model takes one
input (``def __call__(self, batch)`` reading ``batch["image"]``), one line naming
``data.inputs_as`` where the signature does not decide; Python API and CLI alike."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

import train
from train.cli import main
from train.data.user import from_user_function
from train.training.binding import inputs_as_for

IMAGE, TEXT = (4, 4), (6,)


class DictLinen(nn.Module):
    """The common way: one dict argument, read by key (and a train flag, as many models have)."""

    @nn.compact
    def __call__(self, batch, train: bool = False):
        image = batch["image"].reshape(batch["image"].shape[0], -1)
        h = nn.Dense(16)(jnp.concatenate([image, batch["text"]], -1))
        return nn.Dense(3)(nn.Dropout(0.1, deterministic=not train)(nn.relu(h)))


class DictNNX(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(IMAGE[0] * IMAGE[1] + TEXT[0], 3, rngs=rngs)

    def __call__(self, inputs: dict):
        image = inputs["image"].reshape(inputs["image"].shape[0], -1)
        return self.dense(jnp.concatenate([image, inputs["text"]], -1))


class NamedNNX(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(IMAGE[0] * IMAGE[1] + TEXT[0], 3, rngs=rngs)

    def __call__(self, image, text):
        return self.dense(jnp.concatenate([image.reshape(image.shape[0], -1), text], -1))


def _logged(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        return method(*args, **kwargs)

    return wrapper


class DecoratedDict(nn.Module):
    @_logged
    @nn.compact
    def __call__(self, inputs: dict):
        return nn.Dense(3)(inputs["text"])


class PartialDict(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(TEXT[0], 3, rngs=rngs)

    def _forward(self, batch, scale):
        return self.dense(batch["text"]) * scale

    __call__ = functools.partialmethod(_forward, scale=2.0)


class HFStyle(nn.Module):
    """Hugging Face's way: named token inputs, the mode flag as ``deterministic``."""

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, deterministic: bool = True):
        return nn.Dense(3)(nn.Embed(10, 8)(input_ids).mean(1))


class Wrapper(nn.Module):
    """Takes anything: a dict could be its keyword arguments or its one input."""

    @nn.compact
    def __call__(self, *args, **kwargs):
        return nn.Dense(3)(kwargs["text"] if kwargs else args[0]["text"])


def _inputs(rows=2, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.standard_normal((rows, *IMAGE)).astype(np.float32),
            "text": rng.standard_normal((rows, *TEXT)).astype(np.float32)}


@pytest.mark.parametrize("model, expected", [
    (DictLinen(), "dict"), (DictNNX(nnx.Rngs(0)), "dict"), (NamedNNX(nnx.Rngs(0)), "kwargs"),
    (DecoratedDict(), "dict"), (PartialDict(nnx.Rngs(0)), "dict"),
])
def test_the_models_signature_decides_keywords_or_the_dict_whole(model, expected):
    assert inputs_as_for(model, _inputs()) == expected
    assert inputs_as_for(train.bind(model, "mixed_bf16"), _inputs()) == expected  # bound: the same module's call
    assert inputs_as_for(HFStyle(), {"input_ids": 0, "attention_mask": 0}) == "kwargs"


def test_a_signature_that_does_not_decide_is_one_line_naming_both_choices_and_the_key():
    with pytest.raises(ValueError, match=r"^inputs 'image', 'text' \(a dict\) fit Wrapper.__call__\(\*args, \*\*kwargs\) "
                                         r"both as keyword arguments and whole: set data.inputs_as to kwargs "
                                         r"\(Wrapper\(image=..., text=...\)\) or dict \(Wrapper\(inputs\)\)"):
        inputs_as_for(Wrapper(), _inputs())
    with pytest.raises(ValueError, match=r"fit HFStyle.__call__.* neither as keyword arguments \('text' is not a "
                                         r"parameter\) nor whole \('input_ids' is a parameter\).*data.inputs_as"):
        inputs_as_for(HFStyle(), {"input_ids": 0, "text": 0})
    assert inputs_as_for(Wrapper(), _inputs(), "dict") == "dict"
    with pytest.raises(ValueError, match=r"inputs_as='whole'; valid: auto, kwargs, dict"):
        inputs_as_for(Wrapper(), _inputs(), "whole")


def test_a_linen_model_taking_one_dict_trains_and_evaluates_through_the_python_api():
    """It failed inside create_train_state with TypeError: __call__() got an unexpected keyword argument 'image'."""
    state = train.create_train_state(DictLinen(), "mixed_bf16", optax.adam(1e-2), jax.random.key(0), _inputs())
    assert state.inputs_as == "dict"
    x, labels = _inputs(32, seed=1), np.arange(32) % 3
    batch = {"inputs": x, "labels": labels}
    step, losses = train.make_train_step(donate=False), []
    for _ in range(15):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses
    sums = train.make_eval_step()(state, {**batch, "mask": np.ones(32, bool)})
    # the step computes what the model gives for the dict whole (in bfloat16: to its rounding)
    logits = state.apply_fn({"params": state.params}, x)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).sum()
    np.testing.assert_allclose(float(sums["loss_sum"]), float(expected), rtol=2e-3)


def test_an_nnx_model_taking_one_dict_and_a_wrapper_told_how_train_through_the_python_api():
    for model, inputs_as in ((DictNNX(nnx.Rngs(0)), "auto"), (Wrapper(), "dict"), (Wrapper(), "kwargs")):
        state = train.create_train_state(model, "mixed_bf16", optax.adam(1e-2), jax.random.key(0), _inputs(),
                                         inputs_as=inputs_as)
        state, metrics = train.make_train_step(donate=False)(state, {"inputs": _inputs(8), "labels": np.zeros(8, int)})
        assert np.isfinite(float(metrics["loss"])), (model, inputs_as)
    with pytest.raises(ValueError, match=r"^inputs 'image', 'text' \(a dict\) fit Wrapper"):
        train.create_train_state(Wrapper(), "fp32", optax.adam(1e-2), jax.random.key(0), _inputs())


def two_inputs(examples=64):
    """A user's data function: two named inputs in a dict."""
    x = _inputs(examples)
    labels = (x["text"][:, 0] > 0).astype(np.int32) + (x["image"][:, 0, 0] > 0)
    return {"train": {"inputs": x, "labels": labels}, "eval": {"inputs": _inputs(16, 1), "labels": labels[:16]},
            "num_classes": 3}


def _config(tmp_path, model, **data):
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name": f"test_inputs_as.py:{model}"}, "data": {"name": "test_inputs_as.py:two_inputs",
                                                                   "batch_size": 8, **data},
        "steps": 3, "log_every": 3, "eval_every": 0, "checkpoint_every": 0, "progress": False,
        "inference_dtypes": [], "precision": {"policy": "mixed_bf16"}, "workdir": str(tmp_path / model)}))
    return str(path)


def test_the_cli_trains_a_model_taking_one_dict_and_names_data_inputs_as_where_it_must(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "test_inputs_as.py").symlink_to(__file__)
    assert main([_config(tmp_path, "DictLinen")]) == 0
    assert "final train loss" in capsys.readouterr().out
    assert main([_config(tmp_path, "DictLinen"), "--explain"]) == 0  # explain traces the model as the step does
    capsys.readouterr()
    assert main([_config(tmp_path, "Wrapper")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "set data.inputs_as to kwargs" in err[0] and "or dict" in err[0], err
    assert main([_config(tmp_path, "Wrapper", inputs_as="dict")]) == 0


def test_a_user_data_functions_dict_inputs_keep_their_names():
    data = from_user_function(two_inputs, {})
    assert set(data.sample_input(2)) == {"image", "text"}
