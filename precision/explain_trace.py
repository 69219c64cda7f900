"""Tracing for :func:`precision.explain`: a model or function under its policy, traced
abstractly (nothing is computed), forward and backward, with autocast's decisions logged
and each module's stored param dtypes."""

from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from precision.autocast import transform
from precision.autocast.fp8_sites import Fp8Run
from precision.autocast.op_lists import OpLists
from precision.explain_table import short_dtype as _short
from precision.fp8 import Fp8Options
from precision.modules import LinenWithPolicy, NNXWithPolicy
from precision.policy import Policy

__all__ = ["Traced", "trace_linen", "trace_nnx", "trace_function"]


class Traced(NamedTuple):
    forward: Any  # jaxpr of the forward pass
    backward: Any  # jaxpr of forward + backward (or None)
    log: list
    params: dict[str, tuple[str, ...]]  # module path -> stored param dtypes
    root: str  # the leading scope name to drop (Linen's root module class)
    name: str
    wrapped: Any


def _cotangents(out: Any) -> Any:
    def one(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.ones(x.shape, x.dtype)
        return np.zeros(x.shape, jax.dtypes.float0)
    return jax.tree_util.tree_map(one, out)


def _trace(fn: Callable, diff: Any, rest: Any, backward: bool, log: list) -> tuple[Any, Any]:
    """Jaxprs of ``fn(diff, rest)`` and of its VJP with respect to ``diff``."""
    forward = jax.make_jaxpr(lambda d, r: fn(d, r, log))(diff, rest)
    if not backward:
        return forward, None

    def vjp(d, r):  # through the rest too: NNX state must enter the traced function as an argument
        out, pullback = jax.vjp(lambda d_, r_: fn(d_, r_, None), d, r)
        return pullback(_cotangents(out))[0]

    return forward, jax.make_jaxpr(vjp)(diff, rest)


def _param_dtypes(params: Any) -> dict[str, tuple[str, ...]]:
    """Stored dtypes of the params of each module path (Linen dicts or NNX state)."""
    by_module: dict[str, set] = collections.defaultdict(set)
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, leaf in leaves:
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        dtype = leaf.get_value().dtype if isinstance(leaf, nnx.Variable) else leaf.dtype
        by_module["/".join(names[:-1])].add(np.dtype(dtype).name)
    return {k: tuple(sorted(_short(d) for d in v)) for k, v in by_module.items()}


def trace_linen(wrapped: LinenWithPolicy, args: tuple, kwargs: dict, backward: bool) -> Traced:
    kwargs = dict(kwargs)
    rngs = kwargs.pop("rngs", None) or {"dropout": jax.random.key(0)}
    variables = jax.eval_shape(lambda: wrapped.init(jax.random.key(0), *args, **kwargs))
    state = {k: v for k, v in variables.items() if k != "params"}
    mutable = list(state) or False

    def fn(params, state, log):
        out = wrapped.apply_logged({**state, "params": params}, *args, mutable=mutable, rngs=rngs, log=log,
                                   **kwargs)
        return out[0] if mutable else out

    log: list = []
    fwd, bwd = _trace(fn, variables.get("params", {}), state, backward, log)
    name = type(wrapped.module).__name__
    return Traced(fwd, bwd, log, _param_dtypes(variables.get("params", {})), "", name, wrapped)


def trace_nnx(wrapped: NNXWithPolicy, args: tuple, kwargs: dict, backward: bool) -> Traced:
    graphdef, params, rest = nnx.split(wrapped, nnx.Param, ...)

    def fn(params, rest, log):
        return nnx.merge(graphdef, params, rest).call_logged(log, *args, **kwargs)

    log: list = []
    fwd, bwd = _trace(fn, params, rest, backward, log)
    module_params = nnx.state(wrapped.module, nnx.Param)
    name = type(wrapped.module).__name__
    return Traced(fwd, bwd, log, _param_dtypes(module_params), "", name, wrapped)


def trace_function(fn: Callable, policy: Policy, ops: OpLists, args: tuple, kwargs: dict,
                    backward: bool, fp8: Fp8Options) -> Traced:
    floats = [i for i, a in enumerate(args) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact)]

    def run(diff, rest, log):
        full = list(rest)
        for i, a in zip(floats, diff):
            full[i] = a
        return transform.call(fn, tuple(full), kwargs, compute_dtype=policy.compute_dtype, ops=ops, log=log,
                              fp8=policy.fp8, fp8_run=Fp8Run(fp8), matmul_precision=policy.matmul_precision)

    rest = [None if i in floats else a for i, a in enumerate(args)]
    log: list = []
    fwd = jax.make_jaxpr(lambda d: run(d, rest, log))([args[i] for i in floats])
    bwd = None
    if backward and floats:
        def vjp(d):
            out, pullback = jax.vjp(lambda d_: run(d_, rest, None), d)
            return pullback(_cotangents(out))
        bwd = jax.make_jaxpr(vjp)([args[i] for i in floats])
    return Traced(fwd, bwd, log, {}, "", getattr(fn, "__name__", "function"), None)
