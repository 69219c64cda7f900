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

from precision.autocast.scaled.fp8_sites import Fp8Run
from precision.autocast.scaled.int8_sites import Int8Run
from precision.autocast.higher_order import RULES
from precision.autocast.interpreter import Context
from precision.autocast.op_lists import OpLists
from precision.autocast.reductions import reduce_dtype_of
from precision.autocast.tracing import evaluate_call, flatten_call
from precision.autocast.values import F32, is_policy_float
from precision.fp8 import Fp8Options, as_fp8_options, init_fp8_state as init_fp8_state_of
from precision.int8 import Int8Options, as_int8_options
from precision.dtype_names import matmul_precision_name
from precision.dtype_names import _is_int8_compute
from precision.policy import Policy, _canonical, _is_fp8_name, get_policy, parse_compute

__all__ = ["autocast", "call", "call_vals", "context", "flatten_call"]


def context(compute_dtype: Any, ops: OpLists | None = None, log: list | None = None, fp8: bool = False,
            fp8_run: Fp8Run | None = None, reduce_dtype: Any = None, matmul_precision: Any = "default",
            int8: bool = False, int8_run: Int8Run | None = None) -> Context:
    """The interpreter's context for a program computing in ``compute_dtype``
    (its matmuls in FP8 if ``fp8``, with ``fp8_run``'s options and state; in int8
    if ``int8``, with ``int8_run``'s options; the gradients of its half ops in
    ``reduce_dtype`` when given; its float32 matmuls at least at ``matmul_precision``)."""
    return Context(root=np.dtype(compute_dtype), ops=ops or OpLists(), rules=RULES, log=log, root_fp8=fp8,
                   fp8=fp8_run or Fp8Run(), reduce=None if reduce_dtype is None else np.dtype(reduce_dtype),
                   root_matmul=matmul_precision_name(matmul_precision), root_int8=int8, int8=int8_run or Int8Run())


def call_vals(fn: Callable, args: tuple, kwargs: dict, *, compute_dtype: Any, ops: OpLists | None = None,
              log: list | None = None, fp8: bool = False, fp8_run: Fp8Run | None = None,
              reduce_dtype: Any = None, matmul_precision: Any = "default", int8: bool = False,
              int8_run: Int8Run | None = None) -> Any:
    """Runs ``fn(*args, **kwargs)`` under autocast; returns its output pytree with
    :class:`~precision.autocast.values.Val` leaves (each knows its kind and gives
    its array in any dtype).

    ``fn`` is traced with every policy-float array leaf seen as float32, so
    the program is the same whatever dtypes the arguments or the layers have.
    ``log`` collects :class:`~precision.autocast.values.Record`\\ s of the decisions taken.
    ``fp8``: matmuls in FP8 outside any region saying otherwise; ``fp8_run``:
    their options, the amax histories read and the sites collected.
    ``int8``: matmuls and convolutions in int8 outside any region saying
    otherwise; ``int8_run``: their options (:func:`precision.int8_options`).
    ``reduce_dtype``: the dtype the gradients of half matmuls, broadcasts and
    gathers are produced in, hence reduced in across devices (see
    :mod:`precision.autocast.reductions`); ``None``: their own dtype.
    ``matmul_precision``: the least precision of its float32 matmuls and
    convolutions (:mod:`precision.autocast.matmul_precision`).
    """
    vals, _, flat = evaluate_call(fn, args, kwargs, context(compute_dtype, ops, log, fp8, fp8_run, reduce_dtype,
                                                            matmul_precision, int8, int8_run), top=True)
    return flat.unflatten(vals)


def call(fn: Callable, args: tuple, kwargs: dict, *, compute_dtype: Any, ops: OpLists | None = None,
         log: list | None = None, fp8: bool = False, fp8_run: Fp8Run | None = None, reduce_dtype: Any = None,
         matmul_precision: Any = "default", int8: bool = False, int8_run: Int8Run | None = None) -> Any:
    """Runs ``fn`` under autocast, every output in the dtype ``fn`` itself gives it."""
    vals, shapes, flat = evaluate_call(fn, args, kwargs, context(compute_dtype, ops, log, fp8, fp8_run, reduce_dtype,
                                                                 matmul_precision, int8, int8_run), top=True)
    if any(is_policy_float(x.dtype) and np.dtype(x.dtype) != F32 for x in flat.arrays):
        shapes = jax.eval_shape(flat.fn, *flat.arrays)  # the dtypes fn gives to its half inputs
    results = [val.as_dtype(shape.dtype) if val.managed and is_policy_float(shape.dtype) else val.array
               for val, shape in zip(vals, shapes)]
    return flat.unflatten(results)


def autocast(fn: Callable, policy: "str | Policy | Any" = "mixed_bf16", *, ops: OpLists | None = None,
             fp8: "Fp8Options | dict | None" = None, reduce_dtype: Any = None,
             int8: "Int8Options | dict | None" = None) -> Callable:
    """``fn`` transformed to compute in ``policy``'s compute dtype, whatever dtypes it pins.

    Matmuls and convolutions run in the compute dtype; deny-listed ops and what
    only feeds them in float32; the rest follows its inputs (see
    :mod:`precision.autocast` and :mod:`precision.op_lists`). Outputs keep the
    dtypes ``fn`` gives them, so ``autocast(fn)`` is a drop-in replacement under
    ``jax.grad`` and ``jax.jit``: gradients with respect to float32 inputs are float32.

    Args:
      fn: any function of arrays (pytrees in and out); non-array arguments
        (Python numbers, flags) are static.
      policy: a :class:`Policy`, spec or preset; its compute dtype and the
        precision of float32 matmuls (``matmul=highest``) are used (a bare dtype
        name such as ``"bf16"`` works too).
      ops: the allow/deny lists (:func:`precision.op_lists`); default lists otherwise.
      fp8: :func:`precision.fp8_options` for a policy whose compute is ``f8``
        (``"mixed_fp8"``, or a bare ``"f8"``). Under delayed scaling the
        function takes the amax histories as keyword ``fp8_state=`` (from
        ``autocast_fn.init_fp8_state(*args)``; the gradient with respect to
        them is their new value); without it each matmul is scaled currently.
      int8: :func:`precision.int8_options` for a policy whose compute is ``int8``
        (``"mixed_int8"``): the backward's products, stochastic rounding, ``min_size``.
      reduce_dtype: the dtype the gradients of half-precision matmuls,
        broadcasts and gathers are produced in (``None``: their compute dtype).
        Under data parallelism XLA reduces a weight gradient across devices
        where it is produced, in that dtype: ``"f32"`` sums the devices' parts
        in float32, as one device would (see :mod:`precision.autocast.reductions`).
    """
    if not callable(fn):
        raise TypeError(f"autocast expects a callable, got {type(fn).__name__} {fn!r}")
    compute, on, matmul, int8_on = _compute(policy)
    options, int8_options = as_fp8_options(fp8), as_int8_options(int8)
    reduce_dtype = reduce_dtype_of(reduce_dtype)

    def autocast_fn(*args: Any, fp8_state: dict | None = None, **kwargs: Any) -> Any:
        return call(fn, args, kwargs, compute_dtype=compute, ops=ops, fp8=on,
                    fp8_run=Fp8Run(options, state=fp8_state), reduce_dtype=reduce_dtype, matmul_precision=matmul,
                    int8=int8_on, int8_run=Int8Run(int8_options))

    def init_fp8_state(*args: Any, **kwargs: Any) -> dict:
        """Zero amax histories for every FP8 matmul ``fn(*args, **kwargs)`` makes (delayed scaling)."""
        run = Fp8Run(options, sites=[])
        jax.eval_shape(lambda: call(fn, args, kwargs, compute_dtype=compute, ops=ops, fp8=on, fp8_run=run))
        return init_fp8_state_of(run.sites, options.history)

    autocast_fn.__name__ = f"autocast_{getattr(fn, '__name__', 'fn')}"
    autocast_fn.__doc__ = fn.__doc__
    autocast_fn.init_fp8_state = init_fp8_state  # type: ignore[attr-defined]
    return autocast_fn


def _compute(policy: Any) -> tuple[np.dtype, bool, str, bool]:
    """(compute dtype, FP8 matmuls, float32 matmul precision, int8 matmuls) of a policy, spec,
    preset or bare dtype name."""
    if isinstance(policy, str) and "=" not in policy and "," not in policy:
        if _is_fp8_name(policy):
            return parse_compute(policy), True, "default", False
        if _is_int8_compute(policy):
            return parse_compute(policy), False, "default", True
        try:
            return _canonical(policy), False, "default", False
        except Exception:
            pass
    resolved = get_policy(policy)
    return resolved.compute_dtype, resolved.fp8, resolved.matmul_precision, resolved.int8
