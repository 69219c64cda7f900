"""The entry points of autocast: a function transformed to run under a compute dtype.

``autocast(fn, "mixed_bf16")`` traces ``fn`` with its floating inputs seen as
float32 (:mod:`.tracing`) and evaluates the traced program again under the
policy's compute dtype (:mod:`.interpreter`, with :mod:`.higher_order`'s rules
for sub-programs): matmuls and convolutions in half, softmax, norm statistics
and losses in float32, the rest following its inputs.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from precision.autocast.higher_order import RULES
from precision.autocast.interpreter import Context
from precision.autocast.op_lists import OpLists
from precision.autocast.tracing import evaluate_call, flatten_call
from precision.autocast.values import F32, is_policy_float
from precision.policy import Policy, _canonical, get_policy

__all__ = ["autocast", "call", "call_vals", "context", "flatten_call"]


def context(compute_dtype: Any, ops: OpLists | None = None, log: list | None = None) -> Context:
    """The interpreter's context for a program computing in ``compute_dtype``."""
    return Context(root=np.dtype(compute_dtype), ops=ops or OpLists(), rules=RULES, log=log)


def call_vals(fn: Callable, args: tuple, kwargs: dict, *, compute_dtype: Any, ops: OpLists | None = None,
              log: list | None = None) -> Any:
    """Runs ``fn(*args, **kwargs)`` under autocast; returns its output pytree with
    :class:`~precision.autocast.values.Val` leaves (each knows its kind and gives
    its array in any dtype).

    ``fn`` is traced with every policy-float array leaf seen as float32, so
    the program is the same whatever dtypes the arguments or the layers have.
    ``log`` collects :class:`~precision.autocast.values.Record`\\ s of the decisions taken.
    """
    vals, _, flat = evaluate_call(fn, args, kwargs, context(compute_dtype, ops, log))
    return flat.unflatten(vals)


def call(fn: Callable, args: tuple, kwargs: dict, *, compute_dtype: Any, ops: OpLists | None = None,
         log: list | None = None) -> Any:
    """Runs ``fn`` under autocast, every output in the dtype ``fn`` itself gives it."""
    vals, shapes, flat = evaluate_call(fn, args, kwargs, context(compute_dtype, ops, log))
    if any(is_policy_float(x.dtype) and np.dtype(x.dtype) != F32 for x in flat.arrays):
        shapes = jax.eval_shape(flat.fn, *flat.arrays)  # the dtypes fn gives to its half inputs
    results = [val.as_dtype(shape.dtype) if val.managed and is_policy_float(shape.dtype) else val.array
               for val, shape in zip(vals, shapes)]
    return flat.unflatten(results)


def autocast(fn: Callable, policy: "str | Policy | Any" = "mixed_bf16", *, ops: OpLists | None = None
             ) -> Callable:
    """``fn`` transformed to compute in ``policy``'s compute dtype, whatever dtypes it pins.

    Matmuls and convolutions run in the compute dtype; deny-listed ops and what
    only feeds them in float32; the rest follows its inputs (see
    :mod:`precision.autocast` and :mod:`precision.op_lists`). Outputs keep the
    dtypes ``fn`` gives them, so ``autocast(fn)`` is a drop-in replacement under
    ``jax.grad`` and ``jax.jit``: gradients with respect to float32 inputs are float32.

    Args:
      fn: any function of arrays (pytrees in and out); non-array arguments
        (Python numbers, flags) are static.
      policy: a :class:`Policy`, spec or preset; only its compute dtype is used
        (a bare dtype name such as ``"bf16"`` works too).
      ops: the allow/deny lists (:func:`precision.op_lists`); default lists otherwise.
    """
    if not callable(fn):
        raise TypeError(f"autocast expects a callable, got {type(fn).__name__} {fn!r}")
    compute = _compute_dtype(policy)

    def autocast_fn(*args: Any, **kwargs: Any) -> Any:
        return call(fn, args, kwargs, compute_dtype=compute, ops=ops)

    autocast_fn.__name__ = f"autocast_{getattr(fn, '__name__', 'fn')}"
    autocast_fn.__doc__ = fn.__doc__
    return autocast_fn


def _compute_dtype(policy: Any) -> np.dtype:
    if isinstance(policy, str) and "=" not in policy and "," not in policy:
        try:
            return _canonical(policy)
        except Exception:
            pass
    return get_policy(policy).compute_dtype
