"""The dtype a program reads each of its arguments in.

A policy stores params in float32 and computes with them in half precision:
the program casts each param to bfloat16 (or float16) where it uses it, except
in float32 islands (norms, a rule-kept module, a deny-listed op). Code that
moves params before the program runs (the all-gather of FSDP-split params)
can move them already cast, at half the bytes, wherever the program would
read nothing but the cast: :func:`read_dtypes` tells where that is.

An argument is read in a half dtype ``h`` when every path from it, through
ops that only move data (reshape, transpose, slice, broadcast...) and into
sub-programs (jit, scan, remat, cond, custom_jvp/vjp, shard_map), ends in a
cast to ``h``. Any other use (arithmetic, a float32 read, an output of the
program, a ``while`` loop) reads it in its own dtype. Casting such an
argument to ``h`` early changes nothing the program computes.

An argument whose every path ends in an FP8 matmul's per-tensor, currently
scaled quantization (:data:`~precision.autocast.scaled.fp8_quantize.FP8_READ`) is
read in E4M3: quantized early with the same scale (from the whole array's
amax) and handed over as its dequantized values, the matmul quantizes it to
the same FP8 values (at most doubled, exactly: the products do not change).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from precision.autocast.scaled.fp8_quantize import E4M3, FP8_READ
from precision.autocast.program import HALF_DTYPES, MOVES, scan_counts

__all__ = ["read_dtypes"]

#: ...and a lookup (gather) selects an operand's values: casting before or after it is the same.
_MOVES_DATA = MOVES | {"optimization_barrier", "gather"}
_OWN = "own"  # read in its own dtype
#: Moves that keep a part of their operand.
_PARTS = frozenset({"slice", "dynamic_slice", "gather"})


def read_dtypes(fn: Callable[[Any], Any], tree: Any) -> Any:
    """For each array of ``tree``, the dtype ``fn(tree)`` reads it in: a half
    dtype where the program only ever uses it cast to that dtype, E4M3 where
    only an FP8 matmul quantizes it (per tensor, current scaling), else the
    array's own dtype. Traces ``fn`` abstractly (nothing is computed)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    closed = jax.make_jaxpr(lambda *xs: fn(jax.tree_util.tree_unflatten(treedef, list(xs))))(*avals)
    jaxpr = closed.jaxpr
    out = []
    for var, leaf in zip(jaxpr.invars, leaves, strict=True):
        reads = {_OWN if isinstance(r, tuple) else r for r in _reads(jaxpr, var)}  # an output: read as is
        only = next(iter(reads)) if len(reads) == 1 else _OWN
        out.append(only if only != _OWN else np.dtype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _reads(jaxpr: Any, var: Any, whole: bool = True) -> set:
    """The dtypes ``var`` is read in within ``jaxpr`` (``_OWN`` for any use that is not a half
    cast), and ``("out", k)`` where it leaves ``jaxpr`` as output ``k``, moved only.
    ``whole``: ``var`` holds every element of the argument (an FP8 read of a part, a
    scanned layer's slice, has a scale of its own: read in the argument's own dtype)."""
    found: set = {("out", k) for k, v in enumerate(jaxpr.outvars) if v is var}
    for eqn in jaxpr.eqns:
        positions = [i for i, v in enumerate(eqn.invars) if v is var]
        if not positions:
            continue
        name = eqn.primitive.name
        if name == "convert_element_type":
            dtype = np.dtype(eqn.params["new_dtype"])
            if dtype == np.dtype(var.aval.dtype):
                found |= _reads(jaxpr, eqn.outvars[0], whole)
            else:
                found.add(dtype if dtype in HALF_DTYPES else _OWN)
        elif name in ("pjit", "jit") and eqn.params.get("name") == FP8_READ:
            found.add(E4M3 if whole else _OWN)
        elif name in _MOVES_DATA and positions == [0]:
            found |= set().union(*(_reads(jaxpr, out, whole and name not in _PARTS) for out in eqn.outvars[:1]))
        else:
            inner = _inner_binders(eqn, positions)
            found |= set().union(*(_leaving(jaxpr, eqn, sub, _reads(sub, v, whole and not part))
                                   for sub, v, part in inner)) if inner else {_OWN}
        if _OWN in found:
            return found
    return found


def _leaving(jaxpr: Any, eqn: Any, sub: Any, reads: set) -> set:
    """``reads`` of a sub-program of ``eqn``, each of its outputs followed on as the result of
    ``eqn`` it is (a jit, remat or custom_vjp returns its body's outputs as they are; a
    scan stacks them, so they count as a read in the own dtype)."""
    found = {r for r in reads if not isinstance(r, tuple)}
    exits = [r[1] for r in reads if isinstance(r, tuple)]
    if exits and (eqn.primitive.name in ("scan", "while") or len(sub.outvars) != len(eqn.outvars)):
        return found | {_OWN}
    for k in exits:
        found |= _reads(jaxpr, eqn.outvars[k], whole=False)
    return found


def _scan_unsliced(params: dict[str, Any]) -> int:
    """How many of a scan's operands pass into its body whole (its constants and carry):
    ``num_consts + num_carry`` before jax 0.11, the first two parts of ``ft_in`` since."""
    return sum(scan_counts(params))


def _inner_binders(eqn: Any, positions: list[int]) -> list[tuple[Any, Any, bool]]:
    """(sub-program, its binder, whether the binder holds a part of the operand) for each
    operand position of ``eqn`` that passes straight into a sub-program (jit, scan, remat,
    custom_jvp/vjp, shard_map: one to one; cond: after the index; a scan's scanned operands
    are sliced); empty when ``eqn`` has none or maps them otherwise (``while``)."""
    name = eqn.primitive.name
    if name == "while":
        return []
    subs = []
    for key, param in eqn.params.items():
        if name in ("custom_vjp_call", "custom_jvp_call", "custom_vjp_call_jaxpr") and key not in (
                "call_jaxpr", "fun_jaxpr"):
            continue
        for item in param if isinstance(param, (tuple, list)) else (param,):
            sub = getattr(item, "jaxpr", item)
            if hasattr(sub, "eqns") and hasattr(sub, "invars"):
                subs.append(sub)
    offset = 1 if name == "cond" else 0
    pairs = []
    for sub in subs:
        if len(sub.invars) != len(eqn.invars) - offset:
            return []
        scanned = _scan_unsliced(eqn.params) if name == "scan" else len(eqn.invars)
        pairs += [(sub, sub.invars[i - offset], i >= scanned) for i in positions if i >= offset]
    if not subs or (offset and 0 in positions):
        return []
    return pairs
