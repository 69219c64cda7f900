"""From a Python function to a program the interpreter rewrites, and back.

:func:`evaluate_call` splits a call ``fn(*args, **kwargs)`` into its array
leaves and its static rest (Python numbers, flags, strings a model sows),
traces it with every policy-float array seen as float32 (so the traced program
is the float32 one, whatever dtypes the arguments or the layers pin), and
evaluates that program under autocast (:mod:`.interpreter`). While it traces,
``jax.nn.dot_product_attention`` calls are marked (:mod:`.fused_attention`).

A *program pass* (:func:`program_pass`) may transform a model's traced call before
autocast sees it: how a layout splits a model across devices is written into the
program there (sharding constraints, split matmuls; ``train.parallel.tensor``), so
that autocast then gives every value of the split program its dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, NamedTuple

import jax
import numpy as np

from precision.autocast import fused_attention
from precision.autocast.interpreter import Context, evaluate
from precision.autocast.values import F32, Val, const_val, is_policy_float, make_val

__all__ = ["Flat", "flatten_call", "evaluate_call", "program_pass", "ProgramPass"]

#: ``(fn, arrays, paths) -> fn``: a function of a call's array leaves (their key paths in the
#: call's ``(args, kwargs)``) transformed before autocast traces it.
ProgramPass = Callable[[Callable, list, list], Callable]
_PASS: contextvars.ContextVar = contextvars.ContextVar("precision_program_pass", default=None)


@contextlib.contextmanager
def program_pass(transform: ProgramPass | None) -> Iterator[None]:
    """Inside, every call autocast makes of a model (:func:`precision.autocast`, the
    ``with_policy`` wrappers) is traced from ``transform(fn, arrays, paths)``: ``fn`` takes the
    call's array leaves, ``arrays`` are those leaves and ``paths`` their key paths in the
    call's ``(args, kwargs)`` (a param's path ends with its path in the params tree). Not
    applied again to the calls the transformed program makes itself."""
    token = _PASS.set(transform)
    try:
        yield
    finally:
        _PASS.reset(token)

_ARRAY = object()


def _is_traced_leaf(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _is_array_output(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def _widened(x: Any) -> jax.ShapeDtypeStruct:
    """The abstract value a floating input is traced as: float32 for any policy float."""
    dtype = F32 if is_policy_float(x.dtype) else x.dtype
    return jax.ShapeDtypeStruct(np.shape(x), dtype)


class Flat(NamedTuple):
    """``fn(*args, **kwargs)`` as a function of its array leaves."""

    fn: Callable  # array leaves in -> array leaves out
    arrays: list  # the array leaves of the arguments
    paths: list  # their key paths in (args, kwargs)
    outputs: dict  # after a trace: "tree" and "static" (non-array output leaves, None for arrays)

    def unflatten(self, arrays: list) -> Any:
        """The output pytree of ``fn`` from its array outputs (static leaves put back)."""
        it = iter(arrays)
        leaves = [next(it) if s is _ARRAY else s for s in self.outputs["static"]]
        return jax.tree_util.tree_unflatten(self.outputs["tree"], leaves)


def flatten_call(fn: Callable, args: tuple, kwargs: dict) -> Flat:
    """Splits a call into traced array leaves and static rest, in and out."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in with_paths]
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

    return Flat(flat, [leaves[i] for i in traced_at], [with_paths[i][0] for i in traced_at], outputs)


def evaluate_call(fn: Callable, args: tuple, kwargs: dict, ctx: Context, top: bool = False
                  ) -> tuple[list[Val], list, Flat]:
    """Traces ``fn(*args, **kwargs)`` with policy floats seen as float32 and
    evaluates it under ``ctx``: (output Vals, their traced shapes, the flattened call).
    ``top``: a model's call (not a sub-program autocast traces again): the
    :func:`program_pass` in effect transforms it first."""
    flat = flatten_call(fn, args, kwargs)
    transform = _PASS.get() if top else None
    traced = flat.fn if transform is None else transform(flat.fn, flat.arrays, flat.paths)
    token = _PASS.set(None)  # the calls the program makes are its own
    try:
        with fused_attention.marking():
            closed, shapes = jax.make_jaxpr(traced, return_shape=True)(*map(_widened, flat.arrays))
    finally:
        _PASS.reset(token)
    vals = evaluate(closed.jaxpr, [const_val(c) for c in closed.consts], [make_val(x) for x in flat.arrays], ctx, top)
    return vals, shapes, flat
