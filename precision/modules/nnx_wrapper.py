"""An NNX module under a policy: an ``nnx.Module`` you call like yours, params
stored in their param dtypes, each call under autocast, every method of every
submodule tagged with its path and, where a rule says so, run in a region."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from precision.autocast import transform as autocast_lib
from precision.autocast.scaled.fp8_sites import Fp8Run
from precision.autocast.scaled.int8_sites import Int8Run
from precision.autocast.op_lists import OpLists
from precision.autocast.reductions import reduce_dtype_of
from precision.fp8 import Fp8Options, init_fp8_state
from precision.int8 import Int8Options
from precision.autocast.regions import compute_in, in_module
from precision.modules.common import (Compute, cast_by_path, check_needs_autocast, cast_like, compute_of, vals_in,
                                      vals_like)
from precision.modules.common import region as opened_region
from precision.policy import Policy, _cast_floating
from precision.rules import Resolver, Rule, class_names_of

__all__ = ["NNXWithPolicy"]


def _module_methods(cls: type) -> tuple[str, ...]:
    """The methods through which a call enters an NNX module of class ``cls``:
    ``__call__`` and every public method its classes define (``Embed.attend``),
    not NNX's own (``train``, ``sow``...)."""
    base = set(dir(nnx.Module))
    names = {"__call__"} if callable(getattr(cls, "__call__", None)) else set()
    for klass in cls.__mro__:
        if issubclass(klass, nnx.Module) and klass is not nnx.Module:
            names.update(name for name, value in vars(klass).items()
                         if inspect.isfunction(value) and not name.startswith("_") and name not in base)
    return tuple(sorted(names))


@functools.cache
def _casting_class(cls: type, compute: np.dtype, caller: np.dtype) -> type:
    """A subclass of ``cls`` whose methods compute in ``compute`` and return ``caller``."""

    def casting(method):
        def call(self, *args, **kwargs):
            args, kwargs = _cast_floating((args, kwargs), compute)
            return _cast_floating(method(self, *args, **kwargs), caller)
        return functools.wraps(method)(call)

    methods = {name: casting(getattr(cls, name)) for name in _module_methods(cls)}
    return type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__})


def _submodules(model: nnx.Module, resolve: Resolver):
    """``(module, path, compute dtype, caller's compute dtype)`` for every
    submodule of an NNX model, from the rules."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and path:
            names = tuple(map(str, path))
            parent = next((names[:i] for i in range(len(names) - 1, -1, -1)
                           if isinstance(_at(model, path[:i]), nnx.Module)), ())
            yield node, names, compute_of(resolve(names)), compute_of(resolve(parent))


def _at(model: Any, path: tuple) -> Any:
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) or not hasattr(node, str(key)) else getattr(node, str(key))
    return node


@functools.cache
def _scoped_class(cls: type, path: tuple[str, ...], region: Compute | None) -> type:
    """A subclass of ``cls`` whose methods run tagged with the module's ``path``
    (so autocast and explain see module paths) and, if given, in a region."""

    def scoped(method):
        def call(self, *args, **kwargs):
            with in_module(path):
                if region is None:
                    return method(self, *args, **kwargs)
                with compute_in(region.dtype, fp8=region.fp8, matmul=region.matmul, int8=region.int8):
                    return method(self, *args, **kwargs)
        return functools.wraps(method)(call)

    methods = {name: scoped(getattr(cls, name)) for name in _module_methods(cls)}
    return type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__})


class NNXWithPolicy(nnx.Module):
    """An NNX module under a policy: call it like the module.

    Its params (``self.module``) are stored in the param dtype. Each call runs
    the module under :func:`precision.autocast` (or, with ``autocast=False``,
    on a copy of its params cast to the compute dtype), writes back any state
    the call changed (BatchNorm statistics, RNG counts) in its stored dtype,
    and casts the output. Differentiate it with ``nnx.grad`` like any NNX module.
    """

    def __init__(self, module: nnx.Module, policy: Policy, rules: Sequence[Rule], *, autocast: bool = True,
                 ops: OpLists | None = None, fp8: Fp8Options | None = None, reduce_dtype: Any = None,
                 int8: Int8Options | None = None):
        self.policy = policy
        self.rules = tuple(rules)
        self.autocast = autocast
        self.ops = ops or OpLists()
        self.fp8 = fp8 or Fp8Options()
        self.int8 = int8 or Int8Options()
        self.reduce_dtype = reduce_dtype_of(reduce_dtype)
        check_needs_autocast(policy, self.rules, autocast, self.reduce_dtype)
        self.module = module
        self._cast_stored_params()

    def _resolver(self) -> Resolver:
        classes = {tuple(str(p) for p in path): class_names_of(node)
                   for path, node in nnx.iter_graph(self.module) if isinstance(node, nnx.Module)}
        return Resolver(self.policy, self.rules, classes)

    def _cast_stored_params(self) -> None:
        resolve = self._resolver()
        params = nnx.state(self.module, nnx.Param)
        nnx.update(self.module, cast_by_path(params, lambda path: resolve(path).param_dtype))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_logged(None, *args, **kwargs)

    def call_logged(self, log: list | None, *args: Any, fp8_run: Fp8Run | None = None, **kwargs: Any) -> Any:
        """Calls the module, appending autocast's decisions to ``log`` (for explain);
        ``fp8_run`` carries delayed scaling's amax histories (:meth:`call_with_fp8_state`)."""
        resolve = self._resolver()
        if not self.autocast:
            return self._call_casting(resolve, args, kwargs)
        graphdef, state = nnx.split(self.module)

        def run(state, args, kwargs):
            model = nnx.merge(graphdef, state)
            for node, path, compute, caller in _submodules(model, resolve):
                node.__class__ = _scoped_class(type(node), path, opened_region(compute, caller))
            with in_module(()):
                return model(*args, **kwargs), nnx.state(model)

        root = compute_of(resolve(()))
        out, new_state = autocast_lib.call_vals(run, (state, args, kwargs), {}, compute_dtype=root.dtype, ops=self.ops,
                                                log=log, fp8=root.fp8, fp8_run=fp8_run or Fp8Run(self.fp8),
                                                reduce_dtype=self.reduce_dtype, matmul_precision=root.matmul,
                                                int8=root.int8, int8_run=Int8Run(self.int8))
        nnx.update(self.module, vals_like(new_state, state))
        return vals_in(out, self.policy.output_dtype)

    def call_with_fp8_state(self, fp8_state: dict | None, *args: Any, **kwargs: Any) -> Any:
        """Calls the module, its FP8 matmuls scaled from ``fp8_state``'s amax histories
        (delayed scaling; the gradient with respect to ``fp8_state`` is its new value)."""
        return self.call_logged(None, *args, fp8_run=Fp8Run(self.fp8, state=fp8_state), **kwargs)

    def init_fp8_state(self, *args: Any, **kwargs: Any) -> dict:
        """Zero amax histories for each FP8 matmul a call on ``args`` makes (traced, not run)."""
        run = Fp8Run(self.fp8, sites=[])
        graphdef, state = nnx.split(self)
        jax.eval_shape(lambda s: nnx.merge(graphdef, s).call_logged(None, *args, fp8_run=run, **kwargs), state)
        return init_fp8_state(run.sites, self.fp8.history)

    def _call_casting(self, resolve: Resolver, args: tuple, kwargs: dict) -> Any:
        """The module-level path (``autocast=False``): params cast, casts at rule boundaries."""
        graphdef, params, rest = nnx.split(self.module, nnx.Param, ...)
        params = cast_by_path(params, lambda path: resolve(path).compute_dtype)
        model = nnx.merge(graphdef, params, rest)
        for node, _, compute, caller in _submodules(model, resolve):
            if compute.dtype != caller.dtype:
                node.__class__ = _casting_class(type(node), compute.dtype, caller.dtype)
        root = resolve(())
        out = model(*_cast_floating(args, root.compute_dtype), **_cast_floating(kwargs, root.compute_dtype))
        new_rest = nnx.state(model, nnx.Not(nnx.Param))
        nnx.update(self.module, cast_like(new_rest, rest))
        return self.policy.cast_to_output(out)
