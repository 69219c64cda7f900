"""The values of a rewritten program: each array with its *kind* (what decides
its dtype) and its casts, made once and kept.

A policy manages float16, bfloat16 and float32 values; everything else
(integers, keys, float64, fp8) passes through untouched.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["F32", "Kind", "Val", "Record", "is_policy_float", "cast", "make_val", "const_val", "literal_val"]

F32 = np.dtype(np.float32)
_POLICY_FLOATS = frozenset({np.dtype(np.float16), np.dtype(jnp.bfloat16), F32})


class Kind(enum.IntEnum):
    """What decides a value's dtype in the rewritten program."""

    NEUTRAL = 0  # constant-like: takes the dtype of what it meets
    HALF = 1  # policy-managed: held in the region's compute dtype
    FULL = 2  # a float32 island
    KEEP = 3  # not managed (integers, keys, float64, fp8): passes untouched


class Record(NamedTuple):
    """One decision of autocast, for :func:`precision.explain`."""

    path: tuple[str, ...]  # module path (named scopes) of the op
    primitive: str
    dtype: np.dtype  # the dtype the op computed in
    reason: str


# Reasons an op computed in float32 (or as traced).
DENIED = "deny-listed op"
STATISTICS = "feeds a deny-listed op"
FOLLOWS_F32 = "follows a float32 value"
UPCAST = "explicit upcast in the model"
REGION = "float32 region (a rule)"
AS_TRACED = "kept as traced (dtype-sensitive op)"


def is_policy_float(dtype: Any) -> bool:
    """float16, bfloat16 or float32: the dtypes a policy manages."""
    try:
        return np.dtype(dtype) in _POLICY_FLOATS
    except TypeError:
        return False


def cast(x: Any, dtype: np.dtype, saturate: bool) -> Any:
    """``x`` in ``dtype``; ``saturate`` clips to the finite range instead of overflowing."""
    if saturate and jnp.finfo(dtype).max < jnp.finfo(x.dtype).max:
        bound = float(jnp.finfo(dtype).max)
        if isinstance(x, (np.ndarray, np.generic)):
            return np.asarray(np.clip(x, -bound, bound), dtype)
        x = lax.clamp(np.asarray(-bound, x.dtype), x, np.asarray(bound, x.dtype))
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype)
    return lax.convert_element_type(x, dtype)


class Val:
    """A value of the rewritten program: its kind, the module path that made it,
    and its array in one or more dtypes (casts are made once and kept).

    ``leaf``: an input of the program, or an input moved (cast, reshaped,
    sliced...): a param as a layer reads it, not an activation. The gradients
    of leaves are the ones a data-parallel step reduces across devices
    (:mod:`precision.autocast.reductions`).

    ``const``: computed from literals and concrete constants alone (``iota``,
    ``jnp.arange``...), so the same on every device and every example: a
    position table looked up at such indices is still a param.

    ``source``: for a weight stored in codes, how its array is made again from
    them (:class:`precision.autocast.frozen_reads.Source`), else None.

    ``normalized``: for a norm's result under an int8 policy, the norm and what
    it read (:class:`precision.autocast.scaled.int8_norm.Normalized`): an int8
    product reading it may normalize its input itself. Else None.
    """

    __slots__ = ("kind", "path", "array", "_casts", "leaf", "const", "source", "normalized")

    def __init__(self, kind: Kind, array: Any, path: tuple[str, ...] = (), casts: dict | None = None,
                 leaf: bool = False, const: bool = False, source: Any = None, normalized: Any = None):
        self.kind = kind
        self.array = array
        self.path = path
        self._casts = {} if casts is None else casts
        self.leaf = leaf
        self.const = const
        self.source = source
        self.normalized = normalized

    @property
    def dtype(self) -> Any:
        dtype = self.array.dtype
        return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)

    @property
    def managed(self) -> bool:
        return self.kind is not Kind.KEEP

    def as_dtype(self, dtype: Any) -> Any:
        """The array in ``dtype`` (cast on first use; constants saturate)."""
        dtype = np.dtype(dtype)
        if not self.managed or dtype == self.dtype:
            return self.array
        if dtype not in self._casts:
            self._casts[dtype] = cast(self.array, dtype, saturate=self.kind is Kind.NEUTRAL)
        return self._casts[dtype]

    def apart(self) -> "Val":
        """The same value with casts of its own: a cast made in a branch traced apart stays there."""
        return Val(self.kind, self.array, self.path, dict(self._casts), self.leaf, self.const, self.source,
                   self.normalized)

    def moved(self, array: Any) -> "Val":
        """A slice or reshape of this value (``array``): a param so moved is still one."""
        return Val(self.kind, array, self.path, leaf=self.leaf, const=self.const)

    def retag(self, kind: Kind, path: tuple[str, ...] | None = None) -> "Val":
        """The same array (and casts) under another kind or path."""
        return Val(kind, self.array, self.path if path is None else path, self._casts, self.leaf, self.const,
                   self.source, self.normalized)


def make_val(array: Any, kind: Kind = Kind.HALF, path: tuple[str, ...] = (), const: bool = False) -> Val:
    """A Val for an input array: ``kind`` if it is a policy float, KEEP otherwise."""
    kind = kind if is_policy_float(getattr(array, "dtype", None)) else Kind.KEEP
    return Val(kind, array, path, leaf=True, const=const)


def const_val(c: Any) -> Val:
    """Consts of a traced program: closed-over tracers are data, concrete arrays constants."""
    traced = isinstance(c, jax.core.Tracer)
    return make_val(c, Kind.HALF if traced else Kind.NEUTRAL, const=not traced)


def literal_val(lit: Any) -> Val:
    """A literal of a traced program, as a constant."""
    array = np.asarray(lit.val, lit.aval.dtype) if hasattr(lit.aval, "dtype") else lit.val
    return make_val(array, Kind.NEUTRAL, const=True)
