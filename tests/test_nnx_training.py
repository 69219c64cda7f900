"""NNX models and Linen models without a ``train`` keyword go through the same
train state, steps, accumulation, checkpoints and inference as our own models."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision
from train import (Checkpointer, bind, cast_for_inference, create_train_state, evaluate, make_eval_step,
                   make_train_step, mode_kwargs)
from train.data import load_dataset
from train.training.state import explain_model

DIGITS = load_dataset("digits")


class NNXNet(nnx.Module):
    """BatchNorm and dropout, no ``train`` keyword: modes come from ``model.train()``."""

    def __init__(self, din, dout, *, rngs):
        self.l1 = nnx.Linear(din, 64, rngs=rngs)
        self.bn = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(64, dout, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


class NNXWithTrainFlag(nnx.Module):
    """An NNX model that takes the flag itself, and pins float32 in its layers."""

    def __init__(self, *, rngs):
        self.l1 = nnx.Linear(64, 32, dtype=jnp.float32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(32, 10, dtype=jnp.float32, rngs=rngs)

    def __call__(self, x, train: bool):
        return self.l2(self.drop(nnx.relu(self.l1(x.reshape(x.shape[0], -1))), deterministic=not train))


class DeterministicLinen(nn.Module):
    """Linen, ``deterministic`` instead of ``train`` (the lm1b / wmt convention)."""

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        x = nn.relu(nn.Dense(64, dtype=jnp.float32)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(nn.Dropout(0.2)(x, deterministic=deterministic))


class NoFlagLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1))))


def _train(model, policy, steps=60, accum_steps=1, seed=0, start=None):
    state = start or create_train_state(model, policy, optax.adam(3e-3), jax.random.key(seed),
                                        DIGITS.sample_input(2))
    step = make_train_step(accum_steps=accum_steps, donate=False)
    first = int(state.step)
    for i in range(first, first + steps):
        state, metrics = step(state, DIGITS.train_batch(i, 64, seed))
    return state, metrics


def test_the_training_flag_is_read_from_the_signature():
    assert mode_kwargs(precision.with_policy(DeterministicLinen(), "fp32"), True) == {"deterministic": False}
    assert mode_kwargs(precision.with_policy(DeterministicLinen(), "fp32"), False) == {"deterministic": True}
    assert mode_kwargs(precision.with_policy(NoFlagLinen(), "fp32"), True) == {}
    assert mode_kwargs(bind(NNXNet(64, 10, rngs=nnx.Rngs(0)), "fp32"), True) == {"train": True}


@pytest.mark.parametrize("policy,half", [("mixed_bf16", jnp.bfloat16), ("mixed_f16", jnp.float16)])
def test_an_nnx_model_trains_in_half_precision_to_the_fp32_loss(policy, half):
    model = NNXNet(64, 10, rngs=nnx.Rngs(0))
    kernel_before = np.asarray(model.l1.kernel.get_value())
    fp32, fp32_metrics = _train(model, "fp32")
    mixed, metrics = _train(model, policy)
    # Masters and BatchNorm statistics in float32; the caller's module left as it was.
    assert {x.dtype for x in jax.tree_util.tree_leaves(mixed.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree_util.tree_leaves(mixed.model_state)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(model.l1.kernel.get_value(), kernel_before)
    # Every matmul in the half dtype, forward and backward.
    explanation = explain_model(mixed.model, DIGITS.sample_input(8), train=True, backward=True)
    assert explanation.half_share == 1.0, explanation
    short = {jnp.bfloat16: "bf16", jnp.float16: "f16"}[half]
    assert {d for m in explanation.modules for d in m.matmul_dtypes} == {short}, explanation
    # Batch statistics move; the loss falls to fp32's.
    assert not np.allclose(mixed.model_state["state"]["bn"]["mean"], 0.0)
    assert float(metrics["loss"]) < 0.5 and abs(float(metrics["loss"]) - float(fp32_metrics["loss"])) < 0.15
    accuracy = evaluate(make_eval_step(), mixed, DIGITS.eval_batches(512))["accuracy"]
    fp32_accuracy = evaluate(make_eval_step(), fp32, DIGITS.eval_batches(512))["accuracy"]
    assert accuracy > 0.8 and abs(accuracy - fp32_accuracy) < 0.03  # running statistics still warming up
    served = evaluate(make_eval_step(), cast_for_inference(mixed, "float16"), DIGITS.eval_batches(512))
    assert abs(served["accuracy"] - accuracy) < 0.02


def test_nnx_dropout_is_a_pure_function_of_the_state_key_and_step():
    model = NNXWithTrainFlag(rngs=nnx.Rngs(0))
    a, _ = _train(model, "mixed_bf16", steps=3)
    b, _ = _train(model, "mixed_bf16", steps=3)
    c, _ = _train(model, "mixed_bf16", steps=3, seed=1)
    chex.assert_trees_all_equal(a.params, b.params)
    assert not np.array_equal(a.params["l1"]["kernel"], c.params["l1"]["kernel"])
    # Training mode reached the module's own `train` keyword: dropout changes the outputs.
    x = DIGITS.sample_input(16)
    variables = {"params": a.params}
    k1, k2 = jax.random.split(jax.random.key(0))
    train_out = [a.model.apply(variables, x, train=True, rngs={"dropout": k}) for k in (k1, k2)]
    assert not np.allclose(train_out[0], train_out[1])
    chex.assert_trees_all_equal(a.model.apply(variables, x), a.model.apply(variables, x))


class NNXPlain(nnx.Module):
    def __init__(self, *, rngs):
        self.l1, self.l2 = nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x.reshape(x.shape[0], -1))))


def test_nnx_accumulation_matches_one_big_batch():
    state = create_train_state(NNXPlain(rngs=nnx.Rngs(0)), "fp32", optax.sgd(0.1), jax.random.key(0),
                               DIGITS.sample_input(2))
    batch = DIGITS.train_batch(0, 64, 0)
    whole, m1 = make_train_step(donate=False)(state, batch)
    split, m2 = make_train_step(accum_steps=4, donate=False)(state, batch)
    assert m1.keys() == m2.keys()
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
    chex.assert_trees_all_close(whole.params, split.params, atol=1e-6)


@pytest.mark.parametrize("model", [DeterministicLinen(), NoFlagLinen()], ids=["deterministic", "no_flag"])
def test_linen_models_without_a_train_keyword_train(model):
    state, metrics = _train(model, "mixed_f16", steps=80)
    assert float(metrics["loss"]) < 0.9
    assert evaluate(make_eval_step(), state, DIGITS.eval_batches(512))["accuracy"] > 0.8


def test_an_nnx_state_checkpoints_and_resumes_bit_exactly(tmp_path):
    model = NNXNet(64, 10, rngs=nnx.Rngs(0))
    straight, _ = _train(model, "mixed_f16", steps=8)
    half, _ = _train(model, "mixed_f16", steps=4)
    checkpoints = Checkpointer(tmp_path / "ckpt")
    checkpoints.save(half, {"data_position": 4})
    checkpoints.close()
    template = create_train_state(model, "mixed_f16", optax.adam(3e-3), jax.random.key(1), DIGITS.sample_input(2))
    restored, meta = Checkpointer(tmp_path / "ckpt").restore_latest_good(template)
    assert meta["data_position"] == 4 and int(restored.step) == 4
    resumed, _ = _train(model, "mixed_f16", steps=4, start=restored)
    chex.assert_trees_all_equal(resumed.params, straight.params)
    chex.assert_trees_all_equal(resumed.model_state, straight.model_state)
    chex.assert_trees_all_equal(resumed.opt_state, straight.opt_state)


def test_an_nnx_state_starts_from_given_float32_variables_under_o2():
    model = NNXNet(64, 10, rngs=nnx.Rngs(0))
    trained, _ = _train(model, "fp32", steps=3)
    variables = {"params": trained.params, **trained.model_state}
    o2 = create_train_state(model, "O2", optax.sgd(0.1), jax.random.key(1), DIGITS.sample_input(2),
                            variables=variables)
    assert o2.params["l1"]["kernel"].dtype == jnp.float16 and o2.params["bn"]["scale"].dtype == jnp.float32
    np.testing.assert_array_equal(o2.params["l1"]["kernel"], trained.params["l1"]["kernel"].astype(jnp.float16))
    chex.assert_trees_all_equal(o2.model_state, trained.model_state)
    with pytest.raises(ValueError, match="do not match the model at state/bn/mean"):
        create_train_state(model, "O2", optax.sgd(0.1), jax.random.key(1), DIGITS.sample_input(2),
                           variables={"params": trained.params})


class NNXSowing(nnx.Module):
    """Sows an intermediate value (nnx.Intermediate) before its BatchNorm."""

    def __init__(self, *, rngs):
        self.l1 = nnx.Linear(64, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x.reshape(x.shape[0], -1))
        self.sow(nnx.Intermediate, "hidden", h)
        return self.l2(self.bn(h))


def test_values_an_nnx_model_sows_never_enter_its_state():
    state, _ = _train(NNXSowing(rngs=nnx.Rngs(0)), "mixed_bf16", steps=2)
    assert set(state.model_state["state"]) == {"bn"}
    assert state.model_state["state"]["bn"]["mean"].shape == (8,)


def test_a_named_training_keyword_is_set_the_way_it_means():
    model = DeterministicLinen()
    state = create_train_state(model, "fp32", optax.sgd(0.1), jax.random.key(0), DIGITS.sample_input(2))
    batch = DIGITS.train_batch(0, 64, 0)
    named, _ = make_train_step(donate=False, train_kwarg="deterministic")(state, batch)
    auto, _ = make_train_step(donate=False)(state, batch)
    chex.assert_trees_all_equal(named.params, auto.params)  # deterministic=False while training: dropout on
