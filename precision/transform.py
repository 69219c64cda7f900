"""Autocast: a JAX transformation that runs a function under a compute dtype.

``autocast(fn, "mixed_bf16")`` traces ``fn`` with its floating inputs seen as
float32 (so whatever dtypes its layers pin, the traced program is the float32
one) and evaluates the traced program again under the policy's compute dtype
(:mod:`precision.interpreter`): matmuls and convolutions in half, softmax,
norm statistics and losses in float32, the rest following its inputs.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from precision import fused_attention, higher_order  # noqa: F401  (registers the higher-order rules)
from precision.interpreter import F32, Context, Val, const_val, evaluate, is_policy_float, make_val
from precision.op_lists import OpLists
from precision.policy import Policy, _canonical, get_policy

__all__ = ["autocast", "call", "call_vals", "flatten_call"]


def _is_traced_leaf(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _widened(x: Any) -> jax.ShapeDtypeStruct:
    """The abstract value a floating input is traced as: float32 for any policy float."""
    dtype = F32 if is_policy_float(x.dtype) else x.dtype
    return jax.ShapeDtypeStruct(np.shape(x), dtype)


class _Flat(NamedTuple):
    """``fn(*args, **kwargs)`` as a function of its array leaves."""

    fn: Callable  # array leaves in -> array leaves out
    arrays: list  # the array leaves of the arguments
    outputs: dict  # after a trace: "tree" and "static" (non-array output leaves, None for arrays)

    def unflatten(self, arrays: list) -> Any:
        """The output pytree of ``fn`` from its array outputs (static leaves put back)."""
        it = iter(arrays)
        leaves = [next(it) if s is _ARRAY else s for s in self.outputs["static"]]
        return jax.tree_util.tree_unflatten(self.outputs["tree"], leaves)


_ARRAY = object()


def flatten_call(fn: Callable, args: tuple, kwargs: dict) -> _Flat:
    """Splits a call into traced array leaves and static rest (Python numbers,
    flags, strings a model sows), in and out."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    traced_at = [i for i, x in enumerate(leaves) if _is_traced_leaf(x)]
    outputs: dict = {}

    def flat(*arrays):
        full = list(leaves)
        for i, a in zip(traced_at, arrays):
            full[i] = a
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        out_leaves, outputs["tree"] = jax.tree_util.tree_flatten(fn(*a, **k))
        outputs["static"] = [_ARRAY if _is_array_output(x) else x for x in out_leaves]
        return [x for x in out_leaves if _is_array_output(x)]

    return _Flat(flat, [leaves[i] for i in traced_at], outputs)


def _is_array_output(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def _run(fn: Callable, args: tuple, kwargs: dict, compute_dtype: Any, ops: OpLists | None,
         log: list | None) -> tuple[list, list, _Flat]:
    """Traces ``fn`` with policy floats seen as float32 and evaluates it under
    autocast: (output Vals, their traced shapes, the flattened call)."""
    flat = flatten_call(fn, args, kwargs)
    with fused_attention.marking():
        closed, shapes = jax.make_jaxpr(flat.fn, return_shape=True)(*map(_widened, flat.arrays))
    ctx = Context(root=np.dtype(compute_dtype), ops=ops or OpLists(), log=log)
    vals = evaluate(closed.jaxpr, [const_val(c) for c in closed.consts], [make_val(x) for x in flat.arrays], ctx)
    return vals, shapes, flat


def call_vals(fn: Callable, args: tuple, kwargs: dict, *, compute_dtype: Any, ops: OpLists | None = None,
              log: list | None = None) -> Any:
    """Runs ``fn(*args, **kwargs)`` under autocast; returns its output pytree with
    :class:`Val` leaves (each knows its kind and gives its array in any dtype).

    ``fn`` is traced with every policy-float array leaf seen as float32, so
    the program is the same whatever dtypes the arguments or the layers have.
    ``log`` collects :class:`Record`s of the decisions taken.
    """
    vals, _, flat = _run(fn, args, kwargs, compute_dtype, ops, log)
    return flat.unflatten(vals)


def call(fn: Callable, args: tuple, kwargs: dict, *, compute_dtype: Any, ops: OpLists | None = None,
         log: list | None = None) -> Any:
    """Runs ``fn`` under autocast, every output in the dtype ``fn`` itself gives it."""
    vals, shapes, flat = _run(fn, args, kwargs, compute_dtype, ops, log)
    if any(is_policy_float(x.dtype) and np.dtype(x.dtype) != F32 for x in flat.arrays):
        shapes = jax.eval_shape(flat.fn, *flat.arrays)  # the dtypes fn gives to its half inputs
    results = [val.as_dtype(shape.dtype) if val.managed and is_policy_float(shape.dtype) else val.array
               for val, shape in zip(vals, shapes)]
    return flat.unflatten(results)


def autocast(fn: Callable, policy: "str | Policy | Any" = "mixed_bf16", *, ops: OpLists | None = None
             ) -> Callable:
    """``fn`` transformed to compute in ``policy``'s compute dtype, whatever dtypes it pins.

    Matmuls and convolutions run in the compute dtype; deny-listed ops and what
    only feeds them in float32; the rest follows its inputs (see the module
    docstring and :mod:`precision.op_lists`). Outputs keep the dtypes ``fn``
    gives them, so ``autocast(fn)`` is a drop-in replacement under ``jax.grad``
    and ``jax.jit``: gradients with respect to float32 inputs are float32.

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
