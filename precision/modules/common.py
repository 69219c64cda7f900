"""What the Linen and NNX adapters share: a policy and its rules resolved from what
the user gave, and trees cast by module path or like a reference tree."""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from precision.autocast.op_lists import OpLists
from precision.autocast.values import Val
from precision.fp8 import FP8_COLLECTION
from precision.policy import Policy, PolicyError, get_policy
from precision.rules import Rule, as_rules, get_rules

__all__ = ["Compute", "compute_of", "region", "uses_fp8", "check_needs_autocast", "split_fp8", "resolve",
           "cast_by_path", "cast_like", "vals_in", "vals_like", "map_params"]


class Compute(NamedTuple):
    """What a module computes in: the dtype of its ops, whether its matmuls are FP8, the
    precision of its float32 matmuls (None in a region: the enclosing one's), and whether
    its matmuls and convolutions are int8."""

    dtype: np.dtype
    fp8: bool
    matmul: str | None = "default"
    int8: bool = False


def compute_of(policy: Policy) -> Compute:
    """The compute of a module under ``policy``."""
    return Compute(policy.compute_dtype, policy.fp8, policy.matmul_precision, policy.int8)


def region(compute: Compute, caller: Compute) -> Compute | None:
    """The region a module computing in ``compute`` opens inside its caller's: None where
    they compute alike; its matmul precision None (kept) where only the dtype differs."""
    if compute == caller:
        return None
    return compute if compute.matmul != caller.matmul else compute._replace(matmul=None)


def uses_fp8(policy: Policy, rules: Iterable[Rule]) -> bool:
    """Whether the policy or any rule runs matmuls in FP8."""
    return policy.fp8 or any(rule.policy.fp8 for rule in rules)


def check_needs_autocast(policy: Policy, rules: Iterable[Rule], autocast: bool, reduce_dtype: Any) -> None:
    """FP8 matmuls, a matmul precision and a ``reduce_dtype`` are made by autocast: a
    wrapper that only casts at module boundaries can have none of them."""
    if autocast:
        return
    if uses_fp8(policy, rules) or any(p.int8 for p in (policy, *(rule.policy for rule in rules))):
        raise ValueError(f"with_policy: {policy} runs matmuls in FP8 or int8, which needs autocast=True "
                         "(autocast=False only casts at module boundaries)")
    asked = next((p for p in (policy, *(rule.policy for rule in rules)) if p.matmul_precision != "default"), None)
    if asked is not None:
        raise PolicyError(f"with_policy: matmul={asked.matmul_precision} ({asked}) is set on float32 matmuls by "
                          "autocast: it needs autocast=True (autocast=False only casts at module boundaries)")
    if reduce_dtype is not None:
        raise PolicyError(f"reduce_dtype={np.dtype(reduce_dtype).name} needs autocast=True (autocast=False only "
                          "casts at module boundaries)")


def split_fp8(variables: Any, mutable: Any) -> tuple[Any, Any, Any]:
    """(the ``"fp8"`` collection or None, the other variables, ``mutable`` without
    ``"fp8"``): the amax histories are the FP8 matmuls' input, not the module's."""
    if not hasattr(variables, "keys") or FP8_COLLECTION not in variables:
        return None, variables, mutable
    rest = {k: v for k, v in variables.items() if k != FP8_COLLECTION}
    if isinstance(mutable, str):
        mutable = False if mutable == FP8_COLLECTION else mutable
    elif isinstance(mutable, (list, tuple)):
        mutable = [m for m in mutable if m != FP8_COLLECTION] or False
    return variables[FP8_COLLECTION], rest, mutable


def resolve(policy: Any, rules: "Iterable[Any] | None", ops: OpLists | None
            ) -> tuple[Policy, tuple[Rule, ...], OpLists]:
    """The policy, rules and op lists a wrapper uses: ``rules=None`` means the preset's
    rules for a preset name, else normalization layers in float32."""
    resolved_policy = get_policy(policy)
    resolved_rules = get_rules(policy) if rules is None and isinstance(policy, str) else as_rules(rules)
    if ops is not None and not isinstance(ops, OpLists):
        raise TypeError(f"with_policy: ops must be a precision.OpLists (from precision.op_lists(...)), "
                        f"got {type(ops).__name__}")
    return resolved_policy, tuple(resolved_rules), ops or OpLists()


def cast_by_path(tree: Any, dtype_of: Callable[[tuple[str, ...]], np.dtype]) -> Any:
    """Casts each floating leaf to ``dtype_of(path of its owning module)``."""

    def cast(key_path, x):
        if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path
                      if not isinstance(k, jax.tree_util.GetAttrKey))
        dtype = dtype_of(names[:-1])
        return x if x.dtype == dtype else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)


def cast_like(new: Any, old: Any) -> Any:
    """Casts floating leaves of ``new`` to the dtype of the same leaf in ``old``."""
    old_dtypes = {path: x.dtype for path, x in jax.tree_util.tree_leaves_with_path(old)
                  if hasattr(x, "dtype")}

    def cast(path, x):
        dtype = old_dtypes.get(path)
        if dtype is None or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x if x.dtype == dtype else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, new)


def vals_in(vals: Any, dtype: np.dtype) -> Any:
    """Arrays of autocast output Vals; floating ones in ``dtype``."""
    def get(val):
        if not isinstance(val, Val):
            return val
        if val.managed and jnp.issubdtype(val.array.dtype, jnp.floating):
            return val.as_dtype(dtype)
        return val.array
    return jax.tree_util.tree_map(get, vals, is_leaf=lambda v: isinstance(v, Val))


def vals_like(vals: Any, reference: Any) -> Any:
    """Arrays of autocast output Vals, each floating one in the dtype of the
    same leaf of ``reference`` (state keeps its stored dtype)."""
    dtypes = {path: x.dtype for path, x in jax.tree_util.tree_leaves_with_path(reference) if hasattr(x, "dtype")}

    def get(path, val):
        if not isinstance(val, Val):
            return val
        return val.as_dtype(dtypes[path]) if val.managed and path in dtypes else val.array

    return jax.tree_util.tree_map_with_path(get, vals, is_leaf=lambda v: isinstance(v, Val))


def map_params(variables: Any, fn: Callable[[Any], Any]) -> Any:
    if not hasattr(variables, "keys") or "params" not in variables:
        return variables
    return {**variables, "params": fn(variables["params"])}


# ----------------------------------------------------------------------------- NNX
