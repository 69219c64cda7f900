"""Train an unmodified Flax MLP on scikit-learn's 8x8 digits in mixed f16.

Policy ``params=f32,compute=f16``: float32 params, float16 math, float32
outputs; dynamic loss scaling; non-finite steps skipped inside ``jax.jit``.

    python examples/mixed_f16_digits.py [--policy params=f32,compute=f16] [--steps 300]
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import precision


class MLP(nn.Module):  # a plain Flax model: no precision code inside
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        x = nn.LayerNorm()(x)  # kept in float32 by the default rules
        return nn.Dense(10)(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description="mixed-precision MLP on 8x8 digits")
    parser.add_argument("--policy", default="params=f32,compute=f16")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

    try:
        policy = precision.get_policy(args.policy)  # "params=f32,compute=f16" by default
    except precision.PolicyError as e:
        parser.error(str(e))
    model = precision.with_policy(MLP(), policy)
    params = model.init(jax.random.key(0), x_train[:1])["params"]
    tx = precision.mixed_precision(optax.adam(1e-3), precision.get_loss_scale("auto", policy))
    opt_state = tx.init(params)

    def loss_fn(params, xb, yb, loss_scale):
        logits = model.apply({"params": params}, xb).astype(jnp.float32)  # loss in float32
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
        return loss_scale.scale(loss), loss

    @jax.jit
    def train_step(params, opt_state, xb, yb):
        loss_scale = precision.current_loss_scale(opt_state)
        grads, loss = jax.grad(loss_fn, has_aux=True)(params, xb, yb, loss_scale)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def accuracy(params, xb, yb):
        return jnp.mean(jnp.argmax(model.apply({"params": params}, xb), -1) == yb)

    rng = np.random.default_rng(1)
    for step in range(1, args.steps + 1):
        idx = rng.integers(0, len(x_train), args.batch)
        params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
        if step % 100 == 0 or step == args.steps:
            scale = precision.current_loss_scale(opt_state)
            print(f"step {step:4d}  loss {float(loss):.4f}  loss_scale {float(scale.loss_scale):g}  "
                  f"skipped {int(scale.skipped_steps)}")
    acc = float(accuracy(params, x_test, y_test))
    print(f"policy {policy}  test accuracy {acc:.4f}")
    return acc


if __name__ == "__main__":
    main()
