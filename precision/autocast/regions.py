"""Compute-dtype regions, carried by JAX's name stack.

A region is a stretch of a program whose matmuls and "follow" ops compute in a
dtype other than the policy's (a module a rule keeps in float32, say). It is a
``jax.named_scope`` whose name is a tag, ``precision:float32``, so it survives
tracing, nested jits, scans, remat and autodiff (JAX keeps name stacks on
every equation), and autocast reads it back from each equation. A region that
also sets the precision of its float32 matmuls says so after an ``@``
(``precision:float32@highest``); one that does not keeps the enclosing one's.

The same name stack gives the module path of every equation: the Flax adapters
(:mod:`precision.modules`) open a scope tagged with the module's whole path,
``precision.module=encoder/layers/0/attn`` (the path of its params and of its
rules), around every method call of a Linen or NNX module. The innermost tag,
followed by any scope the user's code opens inside it, is the module path that
:mod:`precision.explain` reports and that autocast uses to end float32 islands
where a value leaves the module that computed it. A program with no tag (a plain
function) takes its path from its named scopes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence
from urllib.parse import quote, unquote

import jax
import numpy as np

from precision.dtype_names import matmul_precision_name
from precision.dtype_names import _is_int8_compute
from precision.policy import _canonical, _is_fp8_name, parse_compute

__all__ = ["compute_in", "TAG_PREFIX", "MODULE_PREFIX", "tag", "module_tag", "in_module", "scope_names", "region_dtype",
           "region_fp8", "region_int8", "region_matmul", "module_path", "within"]

TAG_PREFIX = "precision:"
MODULE_PREFIX = "precision.module="
_FP8_MARK = "fp8+"  # precision:fp8+bfloat16: FP8 matmuls, the rest in bfloat16
_INT8_MARK = "int8+"  # precision:int8+bfloat16: int8 matmuls and convolutions, the rest in bfloat16
_MATMUL_MARK = "@"  # precision:float32@highest: float32 matmuls at precision HIGHEST


def tag(dtype: Any, fp8: bool = False, matmul: str | None = None, int8: bool = False) -> str:
    """The scope name marking a region that computes in ``dtype`` (matmuls in FP8 if ``fp8``,
    in int8 if ``int8``; float32 matmuls at precision ``matmul``, None: the enclosing region's)."""
    mark = "" if matmul is None else _MATMUL_MARK + matmul_precision_name(matmul)
    scaled = _FP8_MARK if fp8 else _INT8_MARK if int8 else ""
    return TAG_PREFIX + scaled + np.dtype(dtype).name + mark


@contextlib.contextmanager
def compute_in(dtype: Any, *, fp8: bool | None = None, matmul: str | None = None,
               int8: bool | None = None) -> Iterator[None]:
    """Ops traced inside compute in ``dtype`` under autocast (a region).

    ``with precision.compute_in("f32"): y = my_norm(x)`` keeps ``my_norm``'s
    matmuls and arithmetic in float32 under a half policy; its results return
    to the enclosing compute dtype where they leave the region. ``"f8"`` (or
    ``"f8/f16"``) runs the region's matmuls in FP8, the rest in bf16 (f16);
    ``"int8"`` (``"int8/f16"``) its matmuls and convolutions in int8; any
    other dtype turns FP8 and int8 off inside. ``matmul``: the precision of its
    float32 matmuls and convolutions (``"default"``, ``"high"``, ``"highest"``;
    None: the enclosing region's or policy's). Outside autocast it only names a scope.
    """
    if isinstance(dtype, str) and _is_fp8_name(dtype):
        dtype, fp8 = parse_compute(dtype), True
    elif isinstance(dtype, str) and _is_int8_compute(dtype):
        dtype, int8 = parse_compute(dtype), True
    with jax.named_scope(tag(_canonical(dtype), bool(fp8), matmul, bool(int8))):
        yield


def module_tag(path: Sequence[Any]) -> str:
    """The scope name marking the calls of the module at ``path`` (``/`` in a name escaped)."""
    return MODULE_PREFIX + "/".join(quote(str(p), safe="") for p in path)


@contextlib.contextmanager
def in_module(path: Sequence[Any]) -> Iterator[None]:
    """Ops traced inside belong to the module at ``path`` (for explain, rules and islands)."""
    with jax.named_scope(module_tag(path)):
        yield


def scope_names(name_stack: Any) -> tuple[str, ...]:
    """The scope names of an equation's name stack (transform markers dropped)."""
    return tuple(entry.name for entry in getattr(name_stack, "stack", ())
                 if type(entry).__name__ == "Scope")


def region_dtype(scope: tuple[str, ...], default: np.dtype) -> np.dtype:
    """The compute dtype of the innermost region tag in ``scope`` (else ``default``)."""
    for name in reversed(scope):
        if name.startswith(TAG_PREFIX):
            body = name[len(TAG_PREFIX):].removeprefix(_FP8_MARK).removeprefix(_INT8_MARK)
            return np.dtype(body.partition(_MATMUL_MARK)[0])
    return default


def region_fp8(scope: tuple[str, ...], default: bool) -> bool:
    """Whether the innermost region tag in ``scope`` runs matmuls in FP8 (else ``default``)."""
    for name in reversed(scope):
        if name.startswith(TAG_PREFIX):
            return name[len(TAG_PREFIX):].startswith(_FP8_MARK)
    return default


def region_int8(scope: tuple[str, ...], default: bool) -> bool:
    """Whether the innermost region tag in ``scope`` runs matmuls in int8 (else ``default``)."""
    for name in reversed(scope):
        if name.startswith(TAG_PREFIX):
            return name[len(TAG_PREFIX):].startswith(_INT8_MARK)
    return default


def region_matmul(scope: tuple[str, ...], default: str) -> str:
    """The matmul precision of the innermost region tag in ``scope`` that sets one (else ``default``)."""
    for name in reversed(scope):
        if name.startswith(TAG_PREFIX) and _MATMUL_MARK in name:
            return name.partition(_MATMUL_MARK)[2]
    return default


#: Scopes JAX itself opens that are not modules (remat's recomputation).
_JAX_SCOPES = frozenset({"rematted_computation", "checkpoint"})
#: The scope an op bound for a reduce dtype is called in (:mod:`.reductions`): no module of its own.
REDUCE_SCOPE_PREFIX = "precision_reduce_"
#: The scope of a matmul whose sums are split across devices (:mod:`.split_sums`): no module either.
SPLIT_SCOPE_PREFIX = "precision_split_sums:"


def module_path(scope: tuple[str, ...]) -> tuple[str, ...]:
    """The module path of a scope: the innermost module tag's path followed by the
    scopes opened inside it (region tags, JAX's own scopes and ``jnp.einsum``
    specs dropped). Without a tag, the named scopes themselves, a scope repeated
    by a method that calls its parent class's (``SelfAttention_0/SelfAttention_0``)
    counted once."""
    for i in range(len(scope) - 1, -1, -1):
        if scope[i].startswith(MODULE_PREFIX):
            body = scope[i][len(MODULE_PREFIX):]
            base = tuple(unquote(p) for p in body.split("/")) if body else ()
            return base + _named(scope[i + 1:], collapse=False)
    return _named(scope, collapse=True)


def _named(scope: tuple[str, ...], collapse: bool) -> tuple[str, ...]:
    path: list[str] = []
    for name in scope:
        if (name.startswith((TAG_PREFIX, MODULE_PREFIX, REDUCE_SCOPE_PREFIX, SPLIT_SCOPE_PREFIX)) or name in _JAX_SCOPES
                or "->" in name):
            continue
        if not collapse or not path or path[-1] != name:
            path.append(name)
    return tuple(path)


def within(inner: tuple[str, ...], outer: tuple[str, ...]) -> bool:
    """True when scope ``inner`` lies inside (or is) scope ``outer``."""
    return inner[:len(outer)] == outer
