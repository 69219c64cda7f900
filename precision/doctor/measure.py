"""What the doctor measures at one output of one op, and the float32 value it is
measured against (the *shadow*).

For every floating output: the largest finite magnitude (``amax``), how many
values are inf or NaN. For a float16 / bfloat16 output, against its shadow (the op
computed again from the same inputs in float32): how many values are non-zero in
float32 but zero in half (flushed), past the half range but finite in float32
(overflow), subnormal; for float16 in the backward pass, how many would flush at
each loss scale ``2**0 .. 2**24`` (cotangents scale with the loss scale), so the
scales that keep gradients can be read off (from a strided sample of at most
:data:`SAMPLE` values: exact below that size, an estimate above it; the counts at
the scale in use are exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SCALES", "HALF", "MATMULS", "terms", "reduce_terms", "flushed_at", "pack", "unpack", "shadow", "half_matmul"]

F32 = np.dtype(np.float32)
HALF = (np.dtype(np.float16), np.dtype(jnp.bfloat16))
#: The loss scales at which float16 backward flushes are counted: 2**0 .. 2**24.
SCALES = tuple(2.0 ** k for k in range(25))
#: Ops whose half result is their float32 accumulator, rounded once.
MATMULS = ("dot_general", "conv_general_dilated")
#: Values per float16 backward output whose flush bound is kept for the scale grid.
SAMPLE = 4096
#: Outputs reduced together in one variadic reduction.
GROUP = 10
_F16_ZERO_EXPONENT = -25  # below 2**-25, half float16's smallest subnormal (2**-24), a value rounds to zero


def _exponent(magnitude: jax.Array) -> jax.Array:
    """``floor(log2(magnitude))`` of non-negative float32 values, read from their bits
    (-127 for zero and float32 subnormals: below every bound that matters here)."""
    bits = jax.lax.bitcast_convert_type(magnitude, jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def _prime_at_least(n: int) -> int:
    n = max(n, 2)
    while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n


def _sample(values: jax.Array) -> jax.Array:
    """At most :data:`SAMPLE` values, evenly strided (a prime stride: no alignment with a dimension)."""
    stride = 1 if values.size <= SAMPLE else _prime_at_least(-(-values.size // SAMPLE))
    return values[::stride]


def terms(out: jax.Array, ref: jax.Array | None, backward: bool, loss_scale: float) -> tuple[dict, dict, Any]:
    """What :func:`reduce_terms` reduces for one output (traced): the per-value masks counted
    (name -> int32), the magnitudes whose maximum is kept (name -> float32), and for a
    float16 backward output with a shadow, a sample of the bound below which its values flush
    (the loss scales ``2**k``, ``k`` < bound, flush them; 26: zero or non-finite in float32)."""
    x = out.astype(jnp.float32).reshape(-1)
    magnitude = jnp.abs(x)
    counts = {"inf": jnp.isinf(x), "nan": jnp.isnan(x)}
    maxima = {"amax": jnp.where(jnp.isfinite(x), magnitude, 0.0)}
    sample = None
    if np.dtype(out.dtype) in HALF:
        tiny = float(jnp.finfo(out.dtype).tiny)
        counts["subnormal"] = (x != 0) & (magnitude < tiny)
        if ref is not None:
            ref = ref.astype(jnp.float32).reshape(-1)
            ref_finite = jnp.isfinite(ref)
            nonzero = (ref != 0) & ref_finite
            counts["nonzero_ref"] = nonzero
            counts["flushed"] = nonzero & (x == 0)
            counts["overflow"] = jnp.isinf(x) & ref_finite  # past the half range, finite in float32
            maxima["ref_amax"] = jnp.where(ref_finite, jnp.abs(ref), 0.0)
            if backward and np.dtype(out.dtype) == np.float16:
                # At loss scale 2**k a value t (at scale 1) flushes when t * 2**k < 2**-25, that is when
                # k < -25 - floor(log2 t).
                part = _sample(ref)
                bound = jnp.clip(_F16_ZERO_EXPONENT - _exponent(jnp.abs(part) / loss_scale), 0, len(SCALES))
                sample = jnp.where((part != 0) & jnp.isfinite(part), bound, len(SCALES) + 1).astype(jnp.int8)
    return ({k: v.astype(jnp.int32) for k, v in counts.items()}, maxima, sample)


def reduce_terms(items: Sequence[tuple[dict, dict]]) -> list[dict]:
    """The sums of the counts and the maxima of each item: one variadic reduction per
    :data:`GROUP` items of the same size (XLA compiles a reduction at a fixed cost, so
    reductions are few)."""
    results: list[dict] = [{} for _ in items]
    by_size: dict[int, list[int]] = {}
    for i, (counts, _) in enumerate(items):
        by_size.setdefault(int(next(iter(counts.values())).size), []).append(i)
    for members in by_size.values():
        for k in range(0, len(members), GROUP):
            chunk = members[k:k + GROUP]
            names = [(i, name, False) for i in chunk for name in items[i][0]]
            names += [(i, name, True) for i in chunk for name in items[i][1]]
            operands = tuple(items[i][1 if peak else 0][name] for i, name, peak in names)
            inits = tuple(jnp.array(0.0 if peak else 0, x.dtype) for (_, _, peak), x in zip(names, operands))
            peaks = [peak for _, _, peak in names]

            def combine(a, b, peaks=peaks):
                return tuple(jnp.maximum(u, v) if p else u + v for u, v, p in zip(a, b, peaks))

            reduced = jax.lax.reduce(operands, inits, combine, (0,))
            for (i, name, _), value in zip(names, reduced):
                results[i][name] = value
    return results


def flushed_at(sample: np.ndarray, nonzero: int) -> np.ndarray:
    """Of an output's ``nonzero`` float32-non-zero values, how many flush at each loss scale
    of :data:`SCALES`, estimated from the sample of their bounds (exact up to :data:`SAMPLE` values)."""
    bounds = np.asarray(sample, np.int32)
    kept = bounds[bounds <= len(SCALES)]
    if not kept.size:
        return np.zeros(len(SCALES), np.int64)
    share = np.array([np.count_nonzero(kept > k) for k in range(len(SCALES))]) / kept.size
    return np.rint(share * nonzero).astype(np.int64)


def pack(tree: Any) -> tuple[dict, list]:
    """The statistics as one vector per dtype of their scalars, and the other arrays: a few
    transfers back to the host, not one per scalar."""
    leaves = jax.tree_util.tree_leaves(tree)
    scalars: dict[str, list] = {}
    for x in leaves:
        if not x.shape:
            scalars.setdefault(str(x.dtype), []).append(x)
    return {k: jnp.stack(v) for k, v in scalars.items()}, [x for x in leaves if x.shape]


def unpack(packed: tuple[dict, list], like: Any) -> Any:
    """:func:`pack`'s statistics (fetched) in the structure of ``like``, the traced ones."""
    vectors, arrays = packed
    taken = dict.fromkeys(vectors, 0)
    rest = iter(arrays)
    leaves = []
    for x in jax.tree_util.tree_leaves(like):
        if x.shape:
            leaves.append(next(rest))
        else:
            key = str(x.dtype)
            leaves.append(vectors[key][taken[key]])
            taken[key] += 1
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def half_matmul(eqn: Any, ins: Sequence[Any]) -> tuple[jax.Array, jax.Array] | None:
    """A matmul with a half result computed as its float32 accumulator rounded once:
    (the half result, the float32 one, its shadow for free); None for any other op.
    The operands are widened to float32 first (exactly: a product of two half or
    float8 values is exact in float32), which every platform multiplies."""
    out_dtype = eqn.outvars[0].aval.dtype
    if eqn.primitive.name not in MATMULS or np.dtype(out_dtype) not in HALF:
        return None
    wide = [x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and np.dtype(x.dtype).itemsize < 4
            else x for x in ins]
    params = dict(eqn.params, preferred_element_type=F32)
    try:
        out = eqn.primitive.bind(*wide, **params)
    except Exception:  # noqa: BLE001 - operands this platform only multiplies in their own dtype
        return None
    return out.astype(out_dtype), out


def shadow(eqn: Any, ins: Sequence[Any], index: int) -> Any:
    """Output ``index`` of ``eqn`` computed from the same inputs in float32, or None."""
    name = eqn.primitive.name
    if name in ("convert_element_type", "reduce_precision"):
        floating = hasattr(ins[0], "dtype") and jnp.issubdtype(ins[0].dtype, jnp.floating)
        return ins[0] if floating else None  # the value before it was narrowed
    if name.startswith("scatter") or any(hasattr(v, "eqns") or hasattr(v, "jaxpr") for v in eqn.params.values()):
        return None  # a program typed in its dtypes (a scatter's update, a reduction's body): no float32 twin
    wide = [x.astype(jnp.float32) if hasattr(x, "dtype") and np.dtype(x.dtype) in HALF else x for x in ins]
    params = dict(eqn.params)
    if params.get("preferred_element_type") is not None:
        params["preferred_element_type"] = F32
    try:
        out = eqn.primitive.bind(*wide, **params)
    except Exception:  # noqa: BLE001 - an op that only exists in its dtypes: no shadow
        return None
    out = out if eqn.primitive.multiple_results else [out]
    if index >= len(out) or np.dtype(out[index].dtype) != F32:
        return None
    return out[index]
