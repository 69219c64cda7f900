"""The params to evaluate: where the optimizer says the model is, not always where it
takes gradients.

Most optimizers evaluate and take gradients at the same point, the params. The
schedule-free family (``optax.contrib.schedule_free``, ``schedule_free_adamw``,
``schedule_free_sgd``) takes gradients at ``y``, an interpolation between its
average ``x`` and its base iterate ``z``, and the model to evaluate, export or serve
is ``x`` (``optax.contrib.schedule_free_eval_params``). Under ``mixed_precision``
the optimizer sees float32 masters (and, with ``stored_in``, reads its state from
bfloat16 or 8-bit blocks): ``x`` is computed from those, in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax.contrib

from precision.optim import find_mixed_precision_state
from precision.stored import loaded

__all__ = ["evaluation_params", "keeps_evaluation_point"]


#: The state of optax's schedule-free optimizers (optax >= 0.2.2; before, there are none).
_SCHEDULE_FREE = getattr(optax.contrib, "ScheduleFreeState", ())


def _schedule_free_state(opt_state: Any) -> Any:
    """The schedule-free optimizer's state inside ``opt_state`` (also under wrappers), or None."""
    if not _SCHEDULE_FREE:
        return None
    found = [s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, _SCHEDULE_FREE))
             if isinstance(s, _SCHEDULE_FREE)]
    if len(found) > 1:
        raise ValueError(f"the optimizer state holds {len(found)} schedule-free states: which one's average to "
                         f"evaluate is ambiguous; use one schedule_free optimizer for all params")
    return found[0] if found else None


def keeps_evaluation_point(opt_state: Any) -> bool:
    """Whether the optimizer evaluates elsewhere than where it takes gradients (schedule-free)."""
    return _schedule_free_state(opt_state) is not None


def evaluation_params(params: Any, opt_state: Any) -> Any:
    """The float32 params to evaluate, export or re-cast after training:
    :func:`precision.full_precision_params` (the masters, or ``params``), moved to
    a schedule-free optimizer's average ``x`` when the optimizer is one. Traceable."""
    full = _full(params, opt_state)
    state = _schedule_free_state(opt_state)
    if state is None:
        return full
    state = loaded(state)  # stored in bfloat16 or 8-bit blocks: read in float32
    b1 = jnp.asarray(state.b1, jnp.float32)

    def average(y, z):
        if not jnp.issubdtype(y.dtype, jnp.floating):
            return y
        return (jnp.asarray(y, jnp.float32) - (1.0 - b1) * jnp.asarray(z, jnp.float32)) / b1

    return jax.tree_util.tree_map(average, full, state.z)


def _full(params: Any, opt_state: Any) -> Any:
    """``full_precision_params``, in float32 also for bfloat16 params that are their own masters."""
    try:
        state = find_mixed_precision_state(opt_state)
    except ValueError:  # a plain optax state, without mixed_precision
        return params
    if state.master_params is not None:
        return state.master_params
    if state.stored_masters is None:
        return params
    return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                  params)
