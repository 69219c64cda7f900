"""What is diagnosed: a Linen or NNX module (wrapped or not) or a function, as a
program of its params that can be built again under another policy, rules or op
lists (the doctor verifies a change by running it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from precision.autocast import OpLists, autocast
from precision.modules import LinenWithPolicy, NNXWithPolicy, with_policy
from precision.policy import Policy, PolicyError, get_policy
from precision.rules import as_rules

__all__ = ["Subject", "subject_of"]

Program = tuple[Callable[[Any], Any], Any]  # (forward(params) -> outputs, params)


@dataclasses.dataclass
class Subject:
    """A model or function under a policy, rules and op lists, rebuildable under others."""

    name: str
    policy: Policy
    rules: tuple
    ops: OpLists
    build: Callable[[Policy, tuple, OpLists], Program]
    int8: Any = None  # precision.Int8Options of its int8 matmuls (None: the defaults)

    def program(self, policy: Policy | None = None, rules: tuple | None = None, ops: OpLists | None = None) -> Program:
        return self.build(policy or self.policy, self.rules if rules is None else rules, ops or self.ops)


def _init(wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """The module's variables from key 0, initialised in one compiled program (eagerly, op by op,
    each op would compile a program of its own); arguments that are not arrays (a ``train`` flag
    the call branches on) stay Python values."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    traced = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]

    def init(arrays):
        given = list(leaves)
        for i, x in zip(traced, arrays, strict=True):
            given[i] = x
        a, kw = jax.tree_util.tree_unflatten(tree, given)
        return wrapped.init(jax.random.key(0), *a, **kw)

    return jax.jit(init)([leaves[i] for i in traced])


def _linen(module: nn.Module, variables: Any, args: tuple, kwargs: dict, use_autocast: bool, int8: Any = None
           ) -> Callable:
    kwargs = dict(kwargs)
    rngs = kwargs.pop("rngs", None) or {"dropout": jax.random.key(0)}
    if variables is None:
        variables = _init(with_policy(module, "fp32", []), args, kwargs)
    variables = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                                       else x, dict(variables))

    def build(policy: Policy, rules: tuple, ops: OpLists) -> Program:
        wrapped = with_policy(module, policy, list(rules), ops=ops, autocast=use_autocast, int8=int8)
        mutable = [k for k in variables if k != "params"] or False
        # Traced once (abstractly) to record the module structure the rules match, as the call runs.
        jax.eval_shape(lambda v: wrapped.apply(v, *args, rngs=rngs, mutable=mutable, **kwargs), variables)
        stored = wrapped.cast_params(variables)
        state = {k: v for k, v in stored.items() if k != "params"}

        def forward(params):
            out = wrapped.apply({**state, "params": params}, *args, rngs=rngs, mutable=mutable, **kwargs)
            return out[0] if mutable else out

        return forward, stored["params"]

    return build


def _nnx(module: nnx.Module, args: tuple, kwargs: dict, use_autocast: bool, int8: Any = None) -> Callable:
    def build(policy: Policy, rules: tuple, ops: OpLists) -> Program:
        wrapped = with_policy(nnx.clone(module), policy, list(rules), ops=ops, autocast=use_autocast, int8=int8)
        graphdef, params, rest = nnx.split(wrapped, nnx.Param, ...)

        def forward(params):
            fresh = jax.tree_util.tree_map(lambda x: x, rest)  # RNG counters and statistics: this trace's own
            return nnx.merge(graphdef, params, fresh)(*args, **kwargs)

        return forward, params

    return build


def _function(fn: Callable, args: tuple, kwargs: dict, int8: Any = None) -> Callable:
    floats = [i for i, a in enumerate(args) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact)]

    def build(policy: Policy, rules: tuple, ops: OpLists) -> Program:
        if rules:
            raise PolicyError("diagnose: rules apply to modules; for a function use precision.compute_in regions")
        rewritten = autocast(fn, policy, ops=ops, int8=int8)

        def forward(params):
            full = list(args)
            for i, a in zip(floats, params):
                full[i] = a
            return rewritten(*full, **kwargs)

        return forward, [args[i] for i in floats]

    return build


def subject_of(target: Any, args: tuple, kwargs: dict, policy: Any, rules: Any, ops: OpLists | None,
               variables: Any, int8: Any = None) -> Subject:
    """The subject ``target`` names, under ``policy`` (a wrapper's own by default); ``int8``: the
    options of its int8 matmuls (a wrapper's own by default)."""
    use_autocast = getattr(target, "autocast", True)
    if isinstance(target, (LinenWithPolicy, NNXWithPolicy)):
        if policy is not None and get_policy(policy) != target.policy:
            raise ValueError(f"diagnose: policy {policy!r} differs from the wrapped model's {target.policy}; pass "
                             f"policy=None or the unwrapped module")
        if rules is not None or ops is not None:
            raise ValueError("diagnose: rules and ops apply to an unwrapped module; the wrapper has its own")
        module, policy, rules, ops = target.module, target.policy, target.rules, target.ops
        int8 = getattr(target, "int8", None) if int8 is None else int8
        target = module
    elif policy is None:
        raise TypeError("diagnose: pass policy=... (a spec or preset) for an unwrapped model or function")
    name = type(target).__name__ if isinstance(target, (nn.Module, nnx.Module)) else getattr(target, "__name__", "fn")
    resolved = get_policy(policy)
    if rules is None:
        from precision.rules import get_rules

        rules = get_rules(policy) if isinstance(policy, str) else as_rules(None)
    rules, ops = tuple(as_rules(rules)), ops or OpLists()
    if isinstance(target, nn.Module):
        return Subject(name, resolved, rules, ops, _linen(target, variables, args, kwargs, use_autocast, int8), int8)
    if isinstance(target, nnx.Module):
        return Subject(name, resolved, rules, ops, _nnx(target, args, kwargs, use_autocast, int8), int8)
    if callable(target):
        return Subject(name, resolved, (), ops, _function(target, args, kwargs, int8), int8)
    raise TypeError(f"diagnose expects a Flax Linen or NNX module, a with_policy wrapper or a function, got "
                    f"{type(target).__name__}")
