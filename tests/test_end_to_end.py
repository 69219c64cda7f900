"""End to end: a tiny f16 model that stalls without loss scaling and trains with it.

The loss carries a small weight (as auxiliary losses do), so the gradient that
reaches the float16 output, about 4e-9, is below float16's smallest subnormal
(6e-8) and flushes to zero. Dynamic loss scaling lifts it back into range.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import precision

LOSS_WEIGHT = 1e-6


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(32)(x))
        return nn.Dense(1)(x)


def make_data():
    x = jax.random.normal(jax.random.key(1), (256, 8))
    w = jax.random.normal(jax.random.key(2), (8, 1))
    return x, jnp.sin(x @ w)


def train(policy_spec, loss_scale, steps=150):
    x, y = make_data()
    model = precision.with_policy(MLP(), policy_spec)
    params = model.init(jax.random.key(0), x)["params"]
    tx = precision.mixed_precision(optax.adam(3e-3), loss_scale)
    opt_state = tx.init(params)

    def loss_fn(params, scale):
        out = model.apply({"params": params}, x).astype(jnp.float32)
        loss = LOSS_WEIGHT * jnp.mean((out - y) ** 2)
        return scale.scale(loss), loss

    @jax.jit
    def train_step(params, opt_state):
        scale = precision.current_loss_scale(opt_state)
        grads, loss = jax.grad(loss_fn, has_aux=True)(params, scale)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    losses, zero_fraction = [], None
    for i in range(steps):
        params, opt_state, loss, grads = train_step(params, opt_state)
        losses.append(float(loss) / LOSS_WEIGHT)
        if i == 0:
            leaves = [np.asarray(g, np.float32) for g in jax.tree_util.tree_leaves(grads)]
            zero_fraction = sum((g == 0).sum() for g in leaves) / sum(g.size for g in leaves)
    return losses, zero_fraction, opt_state


def test_f16_stalls_without_loss_scaling_and_trains_with_dynamic_scaling():
    ref_losses, ref_zero, _ = train("fp32", precision.NoOpLossScale())
    none_losses, none_zero, _ = train("pure_f16", precision.NoOpLossScale())
    dyn_losses, dyn_zero, state = train("pure_f16", precision.DynamicLossScale(2.0 ** 15, period=50))

    assert ref_zero < 0.05 and dyn_zero < 0.05
    assert none_zero == 1.0  # every gradient value flushed to zero in f16
    assert none_losses[-1] == none_losses[0]  # training stalled completely
    assert ref_losses[-1] < 0.5 * ref_losses[0]
    assert dyn_losses[-1] < 0.5 * dyn_losses[0]
    assert abs(dyn_losses[-1] - ref_losses[-1]) < 0.1 * ref_losses[0]  # recovers the f32 result
    assert float(precision.current_loss_scale(state).loss_scale) >= 2.0 ** 15
