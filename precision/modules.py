"""Applying a precision policy to unmodified Flax modules (Linen and NNX).

``with_policy(module, policy, rules)`` returns an object with the module's own
contract (``init`` / ``apply`` for Linen, a callable ``nnx.Module`` for NNX):
params are stored in the param dtype, outputs leave in the output dtype, and
the forward pass runs under :func:`precision.autocast`: every matmul and
convolution in the compute dtype whatever ``dtype=`` its layers pin, softmax,
norm statistics and other deny-listed ops in float32. Modules a rule matches
compute in the rule's dtype (a region, :mod:`precision.autocast.regions`). The casts sit
inside the differentiated function, so gradients with respect to float32
params come back in float32. Module state other than params (BatchNorm
statistics) stays in its own dtype whatever the compute dtype.

``autocast=False`` gives the older, module-level behaviour: params and inputs
cast to the compute dtype at the module boundary, which layers that pin their
``dtype`` undo (``precision.explain`` reports it).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
from flax import nnx

from precision.autocast import fused_attention, transform as autocast_lib
from precision.autocast.op_lists import OpLists
from precision.autocast.regions import compute_in, in_module
from precision.autocast.values import Val
from precision.policy import Policy, _cast_floating, get_policy
from precision.rules import Resolver, Rule, as_rules, class_names_of, get_rules

__all__ = ["with_policy", "LinenWithPolicy", "NNXWithPolicy"]

PathClasses = dict[tuple[str, ...], tuple[str, ...]]


def with_policy(module: Any, policy: "str | Policy", rules: "Iterable[Any] | None" = None, *,
                autocast: bool = True, ops: OpLists | None = None):
    """Puts an unmodified Flax module under a precision policy.

    Args:
      module: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
      policy: a :class:`Policy`, a ``jmp.Policy`` or a spec string / preset.
      rules: ordered ``(pattern, policy)`` pairs, first match wins (see
        :mod:`precision.rules`). ``None`` means the preset's rules when
        ``policy`` is a preset name (O1 adds softmax, O3 has none), otherwise
        normalization layers in float32. Pass ``[]`` for no rules.
      autocast: run the forward pass under :func:`precision.autocast`, so layers
        that pin ``dtype=float32`` still compute in the policy's dtype (default).
        ``False`` only casts params and inputs at the module boundary.
      ops: autocast's allow/deny lists (:func:`precision.op_lists`).

    Returns:
      A :class:`LinenWithPolicy` (``init`` / ``apply``) or an
      :class:`NNXWithPolicy` (call it like the module).
    """
    resolved_policy = get_policy(policy)
    resolved_rules = (get_rules(policy) if rules is None and isinstance(policy, str)
                      else as_rules(rules))
    if ops is not None and not isinstance(ops, OpLists):
        raise TypeError(f"with_policy: ops must be a precision.OpLists (from precision.op_lists(...)), "
                        f"got {type(ops).__name__}")
    ops = ops or OpLists()
    if isinstance(module, nn.Module):
        return LinenWithPolicy(module, resolved_policy, resolved_rules, autocast=bool(autocast), ops=ops)
    if isinstance(module, nnx.Module):
        return NNXWithPolicy(module, resolved_policy, resolved_rules, autocast=bool(autocast), ops=ops)
    raise TypeError(f"with_policy expects a flax.linen.Module or flax.nnx.Module, got "
                    f"{type(module).__name__}")


def _cast_by_path(tree: Any, dtype_of: Callable[[tuple[str, ...]], np.dtype]) -> Any:
    """Casts each floating leaf to ``dtype_of(path of its owning module)``."""

    def cast(key_path, x):
        if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path
                      if not isinstance(k, jax.tree_util.GetAttrKey))
        dtype = dtype_of(names[:-1])
        return x if x.dtype == dtype else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)


def _cast_like(new: Any, old: Any) -> Any:
    """Casts floating leaves of ``new`` to the dtype of the same leaf in ``old``."""
    old_dtypes = {path: x.dtype for path, x in jax.tree_util.tree_leaves_with_path(old)
                  if hasattr(x, "dtype")}

    def cast(path, x):
        dtype = old_dtypes.get(path)
        if dtype is None or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x if x.dtype == dtype else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, new)


def _intercepted(context: Any) -> bool:
    name = context.method_name
    return name == "__call__" or not (name.startswith("_") or name == "setup")


class LinenWithPolicy:
    """A Linen module under a policy, with the module's ``init`` / ``apply``."""

    def __init__(self, module: nn.Module, policy: Policy, rules: Sequence[Rule], *, autocast: bool = True,
                 ops: OpLists | None = None):
        self.module = module
        self.policy = policy
        self.rules = tuple(rules)
        self.autocast = autocast
        self.ops = ops or OpLists()
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
        """Like ``module.init``; params come back in their (per-module) param dtype."""
        classes: PathClasses = {}
        with self._recording(classes):
            variables = self.module.init(rngs, *args, method=method, **kwargs)
        self._classes = classes
        return self.cast_params(variables)

    def _record_structure(self, variables: Any, *args: Any, **kwargs: Any) -> None:
        classes: PathClasses = {}
        with self._recording(classes), fused_attention.marking():  # traced in float32, as autocast traces
            jax.eval_shape(functools.partial(self.module.apply, **kwargs), variables, *args)
        self._classes = classes

    def with_policy(self, policy: "str | Policy", rules: "Iterable[Any] | None" = None) -> "LinenWithPolicy":
        """The same module under another policy (e.g. float16 for inference), keeping
        the module structure already recorded, so :meth:`cast_params` works at once."""
        other = with_policy(self.module, policy, rules, autocast=self.autocast, ops=self.ops)
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
        return _map_params(variables, lambda p: _cast_by_path(p, lambda path: resolve(path).param_dtype))

    def apply(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
              mutable: Any = False, **kwargs: Any) -> Any:
        """Like ``module.apply``, computing under the policy and its rules."""
        return self.apply_logged(variables, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)

    def apply_logged(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
                     mutable: Any = False, log: list | None = None, **kwargs: Any) -> Any:
        """:meth:`apply` that also appends autocast's decisions to ``log`` (for explain)."""
        if self._classes is None:
            self._record_structure(variables, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)
        resolve = self._resolver()
        if not self.autocast:
            return self._apply_casting(resolve, variables, args, rngs, method, mutable, kwargs)
        root = resolve(()).compute_dtype

        def run(variables, rngs, args, kwargs):
            with nn.intercept_methods(_region_interceptor(resolve, root)):
                return self.module.apply(variables, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)

        vals = autocast_lib.call_vals(run, (variables, rngs, args, kwargs), {}, compute_dtype=root,
                                      ops=self.ops, log=log)
        if mutable is False:
            return _vals_in(vals, self.policy.output_dtype)
        out, updated = vals
        return _vals_in(out, self.policy.output_dtype), _vals_like(updated, variables)

    def _apply_casting(self, resolve: Resolver, variables: Any, args: tuple, rngs: Any, method: Any,
                       mutable: Any, kwargs: dict) -> Any:
        """The module-level path (``autocast=False``): casts at module boundaries only."""
        root = resolve(())
        compute_vars = _map_params(
            variables, lambda p: _cast_by_path(p, lambda path: resolve(path).compute_dtype))
        callers: list[np.dtype] = [root.compute_dtype]

        def cast_calls(next_fun, call_args, call_kwargs, context):
            if not _intercepted(context):
                return next_fun(*call_args, **call_kwargs)
            path = tuple(context.module.path)
            compute = resolve(path).compute_dtype
            caller = callers[-1]
            call_args, call_kwargs = _cast_floating((call_args, call_kwargs), compute)
            callers.append(compute)
            try:
                with in_module(path):
                    out = next_fun(*call_args, **call_kwargs)
            finally:
                callers.pop()
            return out if compute == caller else _cast_floating(out, caller)

        args = _cast_floating(args, root.compute_dtype)
        with nn.intercept_methods(cast_calls):
            result = self.module.apply(compute_vars, *args, rngs=rngs, method=method,
                                       mutable=mutable, **kwargs)
        if mutable is False:
            return self.policy.cast_to_output(result)
        out, updated = result
        return self.policy.cast_to_output(out), _cast_like(updated, variables)


def _region_interceptor(resolve: Resolver, root: np.dtype):
    """A Linen interceptor marking every method call with its module's path, and
    opening a region wherever a module's compute dtype differs from its caller's
    (a rule matched it)."""
    callers: list[np.dtype] = [root]

    def push_region(next_fun, call_args, call_kwargs, context):
        if not _intercepted(context):
            return next_fun(*call_args, **call_kwargs)
        path = tuple(context.module.path)
        compute = resolve(path).compute_dtype
        caller = callers[-1]
        callers.append(compute)
        try:
            with in_module(path):
                if compute == caller:
                    return next_fun(*call_args, **call_kwargs)
                with compute_in(compute):
                    return next_fun(*call_args, **call_kwargs)
        finally:
            callers.pop()

    return push_region


def _vals_in(vals: Any, dtype: np.dtype) -> Any:
    """Arrays of autocast output Vals; floating ones in ``dtype``."""
    def get(val):
        if not isinstance(val, Val):
            return val
        if val.managed and jnp.issubdtype(val.array.dtype, jnp.floating):
            return val.as_dtype(dtype)
        return val.array
    return jax.tree_util.tree_map(get, vals, is_leaf=lambda v: isinstance(v, Val))


def _vals_like(vals: Any, reference: Any) -> Any:
    """Arrays of autocast output Vals, each floating one in the dtype of the
    same leaf of ``reference`` (state keeps its stored dtype)."""
    dtypes = {path: x.dtype for path, x in jax.tree_util.tree_leaves_with_path(reference) if hasattr(x, "dtype")}

    def get(path, val):
        if not isinstance(val, Val):
            return val
        return val.as_dtype(dtypes[path]) if val.managed and path in dtypes else val.array

    return jax.tree_util.tree_map_with_path(get, vals, is_leaf=lambda v: isinstance(v, Val))


def _map_params(variables: Any, fn: Callable[[Any], Any]) -> Any:
    if not hasattr(variables, "keys") or "params" not in variables:
        return variables
    return {**variables, "params": fn(variables["params"])}


# ----------------------------------------------------------------------------- NNX


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
        nnx.update(self.module, _cast_by_path(params, lambda path: resolve(path).param_dtype))

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
        nnx.update(self.module, _vals_like(new_state, state))
        return _vals_in(out, self.policy.output_dtype)

    def _call_casting(self, resolve: Resolver, args: tuple, kwargs: dict) -> Any:
        """The module-level path (``autocast=False``): params cast, casts at rule boundaries."""
        graphdef, params, rest = nnx.split(self.module, nnx.Param, ...)
        params = _cast_by_path(params, lambda path: resolve(path).compute_dtype)
        model = nnx.merge(graphdef, params, rest)
        for node, _, compute, caller in _submodules(model, resolve):
            if compute != caller:
                node.__class__ = _casting_class(type(node), compute, caller)
        root = resolve(())
        out = model(*_cast_floating(args, root.compute_dtype), **_cast_floating(kwargs, root.compute_dtype))
        new_rest = nnx.state(model, nnx.Not(nnx.Param))
        nnx.update(self.module, _cast_like(new_rest, rest))
        return self.policy.cast_to_output(out)
