"""A user's own data and loss, named in a config (see custom_data.yaml):

    data.name: my_data.py:load_digits_split   # returns {"train": arrays, "eval": arrays}
    task: my_data.py:smoothed_cross_entropy   # fn(outputs, batch) -> (loss, metrics)

The framework shuffles, batches, shards and resumes the splits exactly as it
does its own datasets; the loss gets the outputs in float32.
"""

import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits


def load_digits_split(eval_fraction: float = 0.2, seed: int = 0):
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * (1 - eval_fraction))
    train, held_out = order[:cut], order[cut:]
    return {"train": {"inputs": x[train], "labels": y[train]},
            "eval": {"inputs": x[held_out], "labels": y[held_out]},
            "name": "my digits"}


def smoothed_cross_entropy(logits, batch, smoothing: float = 0.1):
    classes = logits.shape[-1]
    targets = optax.smooth_labels(jax_one_hot(batch["labels"], classes), smoothing)
    loss = optax.softmax_cross_entropy(logits, targets).mean()
    accuracy = (jnp.argmax(logits, -1) == batch["labels"]).mean()
    return loss, {"accuracy": accuracy}


def jax_one_hot(labels, classes):
    return (labels[..., None] == jnp.arange(classes)).astype(jnp.float32)
