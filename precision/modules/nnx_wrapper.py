"""An NNX module under a policy: an ``nnx.Module`` you call like yours, params
stored in their param dtypes, each call under autocast, every method of every
submodule tagged with its path and, where a rule says so, run in a region."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Sequence

import numpy as np
from flax import nnx

from precision.autocast import transform as autocast_lib
from precision.autocast.op_lists import OpLists
from precision.autocast.regions import compute_in, in_module
from precision.modules.common import cast_by_path, cast_like, vals_in, vals_like
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
            yield node, names, resolve(names).compute_dtype, resolve(parent).compute_dtype


def _at(model: Any, path: tuple) -> Any:
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) or not hasattr(node, str(key)) else getattr(node, str(key))
    return node


@functools.cache
def _scoped_class(cls: type, path: tuple[str, ...], region: np.dtype | None) -> type:
    """A subclass of ``cls`` whose methods run tagged with the module's ``path``
    (so autocast and explain see module paths) and, if given, in a region."""

    def scoped(method):
        def call(self, *args, **kwargs):
            with in_module(path):
                if region is None:
                    return method(self, *args, **kwargs)
                with compute_in(region):
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
                 ops: OpLists | None = None):
        self.policy = policy
        self.rules = tuple(rules)
        self.autocast = autocast
        self.ops = ops or OpLists()
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

    def call_logged(self, log: list | None, *args: Any, **kwargs: Any) -> Any:
        """Calls the module, appending autocast's decisions to ``log`` (for explain)."""
        resolve = self._resolver()
        if not self.autocast:
            return self._call_casting(resolve, args, kwargs)
        graphdef, state = nnx.split(self.module)

        def run(state, args, kwargs):
            model = nnx.merge(graphdef, state)
            for node, path, compute, caller in _submodules(model, resolve):
                node.__class__ = _scoped_class(type(node), path, None if compute == caller else compute)
            with in_module(()):
                return model(*args, **kwargs), nnx.state(model)

        out, new_state = autocast_lib.call_vals(run, (state, args, kwargs), {},
                                                compute_dtype=resolve(()).compute_dtype, ops=self.ops, log=log)
        nnx.update(self.module, vals_like(new_state, state))
        return vals_in(out, self.policy.output_dtype)

    def _call_casting(self, resolve: Resolver, args: tuple, kwargs: dict) -> Any:
        """The module-level path (``autocast=False``): params cast, casts at rule boundaries."""
        graphdef, params, rest = nnx.split(self.module, nnx.Param, ...)
        params = cast_by_path(params, lambda path: resolve(path).compute_dtype)
        model = nnx.merge(graphdef, params, rest)
        for node, _, compute, caller in _submodules(model, resolve):
            if compute != caller:
                node.__class__ = _casting_class(type(node), compute, caller)
        root = resolve(())
        out = model(*_cast_floating(args, root.compute_dtype), **_cast_floating(kwargs, root.compute_dtype))
        new_rest = nnx.state(model, nnx.Not(nnx.Param))
        nnx.update(self.module, cast_like(new_rest, rest))
        return self.policy.cast_to_output(out)
