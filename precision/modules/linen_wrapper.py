"""A Linen module under a policy: its own ``init`` / ``apply``, params in their
param dtypes, the forward pass under autocast, rules as regions, every method call
tagged with its module's path (:func:`precision.autocast.regions.in_module`)."""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import flax.linen as nn
import jax

from precision.autocast import fused_attention, transform as autocast_lib
from precision.autocast.scaled.fp8_sites import Fp8Run
from precision.autocast.scaled.int8_sites import Int8Run
from precision.autocast.op_lists import OpLists
from precision.autocast.reductions import reduce_dtype_of
from precision.fp8 import FP8_COLLECTION, Fp8Options, init_fp8_state
from precision.int8 import Int8Options
from precision.autocast.regions import compute_in, in_module
from precision.modules.common import (Compute, cast_by_path, check_needs_autocast, cast_like, compute_of, map_params,
                                      region, resolve, split_fp8, uses_fp8, vals_in, vals_like)
from precision.policy import Policy, _cast_floating
from precision.quantized_weights import dequantized, read_in_program
from precision.rules import Resolver, Rule, class_names_of

__all__ = ["LinenWithPolicy"]

PathClasses = dict[tuple[str, ...], tuple[str, ...]]


def _intercepted(context: Any) -> bool:
    name = context.method_name
    return name == "__call__" or not (name.startswith("_") or name == "setup")


class LinenWithPolicy:
    """A Linen module under a policy, with the module's ``init`` / ``apply``."""

    def __init__(self, module: nn.Module, policy: Policy, rules: Sequence[Rule], *, autocast: bool = True,
                 ops: OpLists | None = None, fp8: Fp8Options | None = None, reduce_dtype: Any = None,
                 int8: Int8Options | None = None):
        self.module = module
        self.policy = policy
        self.rules = tuple(rules)
        self.autocast = autocast
        self.ops = ops or OpLists()
        self.fp8 = fp8 or Fp8Options()
        self.int8 = int8 or Int8Options()
        self.reduce_dtype = reduce_dtype_of(reduce_dtype)
        check_needs_autocast(policy, self.rules, autocast, self.reduce_dtype)
        self._classes: PathClasses | None = None  # module structure, recorded once

    def __repr__(self) -> str:
        return (f"LinenWithPolicy({type(self.module).__name__}, {str(self.policy)!r}, "
                f"rules={[(r.pattern, str(r.policy)) for r in self.rules]}, autocast={self.autocast})")

    def _recording(self, classes: PathClasses):
        def record(next_fun, args, kwargs, context):
            classes.setdefault(tuple(context.module.path), class_names_of(context.module))
            return next_fun(*args, **kwargs)
        return nn.intercept_methods(record)

    def _resolver(self) -> Resolver:
        return Resolver(self.policy, self.rules, self._classes or {})

    def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        """Like ``module.init``; params come back in their (per-module) param dtype.

        Under delayed FP8 scaling the variables also hold the ``"fp8"``
        collection: zero amax histories for each FP8 matmul the call makes.
        """
        classes: PathClasses = {}
        with self._recording(classes):
            variables = self.module.init(rngs, *args, method=method, **kwargs)
        self._classes = classes
        variables = self.cast_params(variables)
        if self.fp8.delayed and uses_fp8(self.policy, self.rules):
            run = Fp8Run(self.fp8, sites=[])
            init_rngs = rngs if isinstance(rngs, dict) else {"params": rngs, "dropout": rngs}
            jax.eval_shape(lambda v: self.apply_logged(v, *args, rngs=init_rngs, method=method, mutable=True,
                                                       fp8_run=run, **kwargs), variables)
            variables = {**variables, FP8_COLLECTION: init_fp8_state(run.sites, self.fp8.history)}
        return variables

    def _record_structure(self, variables: Any, *args: Any, **kwargs: Any) -> None:
        classes: PathClasses = {}
        with self._recording(classes), fused_attention.marking():  # traced in float32, as autocast traces
            jax.eval_shape(functools.partial(self.module.apply, **kwargs), variables, *args)
        self._classes = classes

    def with_policy(self, policy: "str | Policy", rules: "Iterable[Any] | None" = None) -> "LinenWithPolicy":
        """The same module under another policy (e.g. float16 for inference), keeping
        the module structure already recorded, so :meth:`cast_params` works at once."""
        other = LinenWithPolicy(self.module, *resolve(policy, rules, self.ops)[:2], autocast=self.autocast,
                                ops=self.ops, fp8=self.fp8, reduce_dtype=self.reduce_dtype, int8=self.int8)
        other._classes = self._classes
        return other

    def cast_params(self, variables: Any, *sample_args: Any, **sample_kwargs: Any) -> Any:
        """Casts the ``params`` collection to each module's param dtype (for loading f32 weights).

        Rules matching class names need the module structure: a wrapper that has
        not run ``init`` or ``apply`` yet needs sample inputs here (traced
        abstractly, nothing is computed).
        """
        if self._classes is None and sample_args:
            self._record_structure(variables, *sample_args, **sample_kwargs)
        if self._classes is None and self.rules:
            raise ValueError("cast_params needs the module structure to match rules by class name: pass "
                             "sample inputs (cast_params(variables, x)), call init or apply once first, or "
                             "derive this wrapper with .with_policy() from one that has run")
        resolve = self._resolver()
        return map_params(variables, lambda p: cast_by_path(p, lambda path: resolve(path).param_dtype))

    def apply(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
              mutable: Any = False, **kwargs: Any) -> Any:
        """Like ``module.apply``, computing under the policy and its rules."""
        return self.apply_logged(variables, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)

    def apply_logged(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
                     mutable: Any = False, log: list | None = None, fp8_run: Fp8Run | None = None,
                     **kwargs: Any) -> Any:
        """:meth:`apply` that also appends autocast's decisions to ``log`` (for explain).

        Weights stored in 8 or 4 bits (:class:`precision.QuantizedWeight`, a fine-tuned
        model's frozen base) are read as floating ones, dequantized in the traced program
        (under autocast by :func:`precision.quantized_weights.read_in_program`: the matmuls
        reading them dequantize them again in their backward pass).
        The ``"fp8"`` collection (amax histories) is read by the FP8 matmuls, not
        by the module; it is returned unchanged when ``mutable`` names it (its
        new value is its gradient, see :mod:`precision.fp8`).
        """
        fp8_state, variables, module_mutable = split_fp8(variables, mutable)
        if self._classes is None:
            self._record_structure(dequantized(variables), *args, rngs=rngs, method=method, mutable=module_mutable,
                                   **kwargs)
        resolve = self._resolver()
        if not self.autocast:
            return self._apply_casting(resolve, dequantized(variables), args, rngs, method, mutable, kwargs)
        root = compute_of(resolve(()))

        def run(variables, rngs, args, kwargs):
            variables = read_in_program(variables)  # 8/4-bit weights read
            with nn.intercept_methods(_region_interceptor(resolve, root)):
                return self.module.apply(variables, *args, rngs=rngs, method=method, mutable=module_mutable,
                                         **kwargs)

        fp8_run = fp8_run or Fp8Run(self.fp8, state=fp8_state)
        vals = autocast_lib.call_vals(run, (variables, rngs, args, kwargs), {}, compute_dtype=root.dtype,
                                      ops=self.ops, log=log, fp8=root.fp8, fp8_run=fp8_run,
                                      reduce_dtype=self.reduce_dtype, matmul_precision=root.matmul,
                                      int8=root.int8, int8_run=Int8Run(self.int8))
        if mutable is False:
            return vals_in(vals, self.policy.output_dtype)
        out, updated = vals if module_mutable is not False else (vals, {})
        updated = vals_like(updated, jax.eval_shape(dequantized, variables))  # as stored: 8/4-bit weights as read
        if fp8_state is not None:
            updated = {**updated, FP8_COLLECTION: fp8_state}
        return vals_in(out, self.policy.output_dtype), updated

    def _apply_casting(self, resolve: Resolver, variables: Any, args: tuple, rngs: Any, method: Any,
                       mutable: Any, kwargs: dict) -> Any:
        """The module-level path (``autocast=False``): casts at module boundaries only."""
        root = resolve(())
        compute_vars = map_params(
            variables, lambda p: cast_by_path(p, lambda path: resolve(path).compute_dtype))

        def cast_call(next_fun, call_args, call_kwargs, compute, caller):
            call_args, call_kwargs = _cast_floating((call_args, call_kwargs), compute.dtype)
            out = next_fun(*call_args, **call_kwargs)
            return out if compute.dtype == caller.dtype else _cast_floating(out, caller.dtype)

        args = _cast_floating(args, root.compute_dtype)
        with nn.intercept_methods(_module_calls(resolve, compute_of(root), cast_call)):
            result = self.module.apply(compute_vars, *args, rngs=rngs, method=method,
                                       mutable=mutable, **kwargs)
        if mutable is False:
            return self.policy.cast_to_output(result)
        out, updated = result
        return self.policy.cast_to_output(out), cast_like(updated, variables)


def _module_calls(resolve: Resolver, root: Compute, call: Any):
    """A Linen interceptor that runs every method call of a module tagged with the
    module's path, through ``call(next_fun, args, kwargs, compute, caller)``: the
    module's compute (dtype and FP8, from the rules) and its caller's."""
    callers: list[Compute] = [root]

    def intercept(next_fun, call_args, call_kwargs, context):
        if not _intercepted(context):
            return next_fun(*call_args, **call_kwargs)
        path = tuple(context.module.path)
        compute = compute_of(resolve(path))
        caller = callers[-1]
        callers.append(compute)
        try:
            with in_module(path):
                return call(next_fun, call_args, call_kwargs, compute, caller)
        finally:
            callers.pop()

    return intercept


def _region_interceptor(resolve: Resolver, root: Compute):
    """Module calls tagged with their path, and a region opened wherever a module's
    compute (dtype, FP8, matmul precision) differs from its caller's (a rule matched it)."""
    def in_region(next_fun, call_args, call_kwargs, compute, caller):
        opened = region(compute, caller)
        if opened is None:
            return next_fun(*call_args, **call_kwargs)
        with compute_in(opened.dtype, fp8=opened.fp8, matmul=opened.matmul, int8=opened.int8):
            return next_fun(*call_args, **call_kwargs)

    return _module_calls(resolve, root, in_region)
