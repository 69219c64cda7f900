"""One training loop written twice on scikit-learn's 8x8 digits (offline): the
Flax-example way (``flax.training.train_state.TrainState``, float32), and the same
loop on ``train.TrainState`` under ``mixed_f16`` (float16 compute, dynamic loss
scaling, non-finite steps skipped), with as few lines changed as possible. Both
start from the same weights and draw the same dropout masks; both losses are printed.

    python examples/flax_train_state.py [--steps 300] [--policy mixed_f16]

The mapping, line by line: docs/flax-habits.md.
"""

import argparse
import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits

import train


class MLP(nn.Module):  # a plain Flax model: BatchNorm statistics and dropout, no precision code
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(128)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
        return nn.Dense(10)(x)


# ----------------------------------------------------------------------------- the Flax way, float32


class FlaxTrainState(train_state.TrainState):
    batch_stats: Any


@jax.jit
def flax_step(state, xb, yb, key):
    dropout_key = jax.random.fold_in(key, state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, xb, train=True,
                                         rngs={"dropout": dropout_key}, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return state, loss


# ----------------------------------------------------------------------------- ours, mixed precision


@jax.jit
def our_step(state, xb, yb, key):
    dropout_key = jax.random.fold_in(key, state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, **state.model_state}, xb, train=True,  # was batch_stats
                                         rngs={"dropout": dropout_key}, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()  # float32 logits (output=f32)
        return loss, updates

    (loss, updates), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params)  # the loss scaled
    state = state.apply_gradients(grads=grads, model_state=updates)  # unscale, skip if not finite, adjust
    return state, loss


# ----------------------------------------------------------------------------- both


def digits(seed: int = 0):
    """Train and test splits of the 8x8 digits, pixels in [0, 1]."""
    data = load_digits()
    x, y = (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    return x[order[:1500]], y[order[:1500]], x[order[1500:]], y[order[1500:]]


def evaluate(apply_fn, variables, x, y):
    """Mean loss and accuracy of the model in eval mode (running BatchNorm statistics)."""
    logits = jax.jit(lambda v: apply_fn(v, x, train=False))(variables).astype(np.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (logits.argmax(-1) == y).mean()


def main(argv=None) -> dict:
    """Trains both ways; returns ``{"flax": ..., "ours": ...}``, each with the first and
    last training losses (``losses``), the test loss and accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--policy", default="mixed_f16")
    args = parser.parse_args(argv)
    x_train, y_train, x_test, y_test = digits()
    model, tx, key = MLP(), optax.adam(1e-3), jax.random.key(1)
    variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), x_train[:1])

    flax_state = FlaxTrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                       batch_stats=variables["batch_stats"])
    try:  # the same weights, under the policy: params float32, compute float16, loss scale dynamic
        our_state = train.create_train_state(model, args.policy, tx, key, x_train[:1], variables=variables)
    except ValueError as e:  # precision.PolicyError: one line, no traceback
        parser.error(str(e))

    results = {}
    for name, step, state in (("flax", flax_step, flax_state), ("ours", our_step, our_state)):
        batches, losses = np.random.default_rng(1), []
        for _ in range(args.steps):
            idx = batches.integers(0, len(x_train), args.batch)
            state, loss = step(state, x_train[idx], y_train[idx], key)
            losses.append(float(loss))
        stats = state.batch_stats if name == "flax" else state.model_state["batch_stats"]
        loss, acc = evaluate(state.apply_fn, {"params": state.params, "batch_stats": stats}, x_test, y_test)
        results[name] = {"losses": losses, "test_loss": float(loss), "test_accuracy": float(acc)}
        what = "float32" if name == "flax" else f"{args.policy}, loss scale " \
            f"{float(state.loss_scale.loss_scale):g}, skipped {int(state.loss_scale.skipped_steps)}"
        print(f"{name} ({what}): train loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f}, "
              f"test loss {float(loss):.3f}, test accuracy {float(acc):.3f}")
    return results


if __name__ == "__main__":
    main()
