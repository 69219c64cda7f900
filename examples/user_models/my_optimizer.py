"""A user's own optimizer and learning-rate schedule, named in a config:

    optimizer:
      name: my_optimizer.py:make           # returns an optax.GradientTransformation
      weight_decay: 1.0e-4                 # a field that is set reaches make's argument of that name
      options: {b2: 0.98}                  # any other argument of make
      schedule: my_optimizer.py:inverse_sqrt
      warmup_steps: 100                    # inverse_sqrt takes warmup_steps: it warms up itself

``make`` gets the schedule as ``learning_rate``; ``inverse_sqrt`` gets ``lr`` and
``warmup_steps`` from the config (see docs/experiments.md, "Optimizers and schedules").
"""

import jax
import jax.numpy as jnp
import optax


def make(learning_rate, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999):
    """AdamW that decays only the matrices (kernels), not biases or norm scales: a mask,
    which a YAML file cannot write."""
    return optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay,
                       mask=lambda params: jax.tree_util.tree_map(lambda p: p.ndim > 1, params))


def inverse_sqrt(lr: float, warmup_steps: int):
    """The Transformer paper's schedule: linear warmup to ``lr``, then ``lr * sqrt(warmup / step)``."""
    warmup = max(warmup_steps, 1)

    def schedule(step):
        step = jnp.maximum(jnp.asarray(step, jnp.float32), 1.0)
        return lr * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

    return schedule
