"""Flax's train-state habits on ours: ``state.apply_fn``, ``state.value_and_grad`` and
``state.apply_gradients`` make the same step as ``make_train_step``, bit for bit, under
every policy; plain gradients are refused where a loss scale would shrink them."""

import functools
import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision
from helpers import assert_bitwise_equal
from train import ScaledGrads, TrainState, create_train_state, get_task, make_train_step
from train.data import load_dataset
from train.models import MLP

DIGITS = load_dataset("digits")
TASK = get_task("classification")
EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "flax_train_state.py"


@functools.cache  # one state (immutable, never donated) per setting: the jitted steps compile once for it
def _state(policy, nnx_model=False, lr=None):
    model = NNXNet(rngs=nnx.Rngs(0)) if nnx_model else MLP(hidden=(16,), dropout=0.1)
    optimizer = optax.adam(1e-2) if lr is None else optax.sgd(lr)
    return create_train_state(model, policy, optimizer, jax.random.PRNGKey(0), DIGITS.sample_input(1))


STEP = make_train_step(donate=False)


def _batch(index=0):
    return DIGITS.train_batch(index, 16, seed=0)


@jax.jit
def flax_style_step(state, batch):
    """The Flax-example loop, on our state: the step ``make_train_step`` makes."""
    rng = jax.random.fold_in(state.rng, state.step)  # the dropout key make_train_step uses

    def loss_fn(params):
        out, updates = state.apply_fn({"params": params, **state.model_state}, batch["inputs"], train=True,
                                      rngs={"dropout": rng}, mutable=list(state.model_state))
        return TASK.loss(out, batch)[0], updates

    (loss, updates), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, model_state=updates), loss


def _leaves(state):
    return jax.tree_util.tree_leaves(state)


def test_apply_gradients_makes_make_train_steps_step_bit_for_bit_under_mixed_f16():
    ours = theirs = _state("mixed_f16")
    for i in range(2):
        ours, loss = flax_style_step(ours, _batch(i))
        theirs, metrics = STEP(theirs, _batch(i))
        assert float(loss) == float(metrics["loss"])
    assert_bitwise_equal(_leaves(ours), _leaves(theirs))
    assert int(ours.step) == 2 and ours.params["Dense_0"]["kernel"].dtype == jnp.float32


def test_a_nonfinite_gradient_or_loss_is_skipped_and_counted_as_our_step_counts():
    state = _state("mixed_f16")
    grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
    bad = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.inf) if g.ndim == 1 else g, grads)
    apply = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    new = apply(state, ScaledGrads(bad))
    assert_bitwise_equal(_leaves(new.params), _leaves(state.params))
    assert float(new.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2  # backed off
    assert int(new.loss_scale.skipped_steps) == 1
    # a skipped step counts, as in make_train_step (whose learning rate reads step - skipped_steps)
    skipped, _ = STEP(state, {**_batch(), "inputs": np.full((16, 8, 8), 1e30, np.float32)})
    assert int(new.step) == int(skipped.step) == 1
    # finite gradients of a non-finite loss: skipped too, and the scale stays (no overflow to fix)
    nan_loss = apply(state, ScaledGrads(grads, jnp.float32(jnp.nan)))
    assert_bitwise_equal(_leaves(nan_loss.params), _leaves(state.params))
    assert float(nan_loss.loss_scale.loss_scale) == float(state.loss_scale.loss_scale)


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16"])
def test_float32_masters_take_the_update_and_params_are_stored_as_the_policy_says(policy):
    state = _state(policy, lr=1e-4)
    grads = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, 1.0, p.dtype), state.params)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)  # no loss scale in bf16: plain grads
    stored = precision.get_policy(policy).param_dtype
    mp = precision.find_mixed_precision_state(new.opt_state)
    masters = new.params if mp.master_params is None else mp.master_params
    bias, master = new.params["Dense_0"]["bias"], masters["Dense_0"]["bias"]
    assert bias.dtype == stored and master.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(master), -1e-4, rtol=1e-6)  # bias starts at 0: one step of -lr * 1
    np.testing.assert_array_equal(np.asarray(bias), np.asarray(master.astype(stored)))


def test_apply_fn_is_the_model_under_its_policy_for_linen_and_nnx():
    state = _state("mixed_f16")
    variables = {"params": state.params, **state.model_state}
    x = DIGITS.sample_input(4)
    ours = jax.jit(lambda v: state.apply_fn(v, x, train=False))(variables)
    wrapped = precision.with_policy(MLP(hidden=(16,), dropout=0.1), "mixed_f16")
    assert ours.dtype == jnp.float32
    theirs = jax.jit(lambda v: wrapped.apply(v, x, train=False))(variables)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    full = jax.jit(lambda v: MLP(hidden=(16,), dropout=0.1).apply(v, x, train=False))(variables)
    assert not np.array_equal(np.asarray(ours), np.asarray(full))  # computed in float16
    np.testing.assert_allclose(np.asarray(ours), np.asarray(full), atol=2e-2)


class NNXNet(nnx.Module):
    """BatchNorm and dropout, modes from ``model.train()`` / ``model.eval()``."""

    def __init__(self, *, rngs):
        self.l1 = nnx.Linear(64, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x.reshape(x.shape[0], -1))))))


def test_an_nnx_model_trains_through_apply_fn_as_make_train_step_trains_it():
    ours = theirs = _state("mixed_f16", nnx_model=True)
    assert set(ours.model_state) == {"state"}
    ours, _ = flax_style_step(ours, _batch())
    theirs, _ = STEP(theirs, _batch())
    assert_bitwise_equal(_leaves(ours), _leaves(theirs))
    assert not np.allclose(np.asarray(ours.model_state["state"]["bn"]["mean"]), 0.0)  # batch statistics moved


def test_plain_gradients_are_refused_where_a_loss_scale_would_shrink_them():
    state, batch = _state("mixed_f16"), _batch()

    def loss_fn(params):
        return TASK.loss(state.apply_fn({"params": params}, batch["inputs"]), batch)[0]

    grads, scaled = jax.jit(lambda p: (jax.grad(loss_fn)(p), state.grad(loss_fn)(p)))(state.params)
    with pytest.raises(ValueError, match=r"scales the loss \(DynamicLossScale\).*state.value_and_grad"):
        jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)  # the Flax habit: unscaled loss
    with pytest.raises(ValueError, match="do not match state.params at Dense_0/bias"):
        state.apply_gradients(grads=ScaledGrads({"params": grads}))
    with pytest.raises(TypeError, match="create_train_state"):
        TrainState.create(apply_fn=None, params=state.params, tx=optax.adam(1e-3))
    ratio = jax.tree_util.tree_map(lambda s, g: float(jnp.max(jnp.abs(s))) / float(jnp.max(jnp.abs(g))),
                                   scaled.grads, grads)
    np.testing.assert_allclose(jax.tree_util.tree_leaves(ratio), 2.0 ** 15, rtol=2e-2)  # what they would lose


def test_the_example_trains_both_ways_to_the_same_loss():
    results = runpy.run_path(str(EXAMPLE))["main"](["--steps", "120"])
    flax, ours = results["flax"], results["ours"]
    for run in (flax, ours):
        assert np.mean(run["losses"][-10:]) < np.mean(run["losses"][:10]) / 3  # both learn
    np.testing.assert_allclose(np.mean(ours["losses"][-10:]), np.mean(flax["losses"][-10:]), rtol=0.02)
    np.testing.assert_allclose(ours["test_loss"], flax["test_loss"], rtol=0.02)
