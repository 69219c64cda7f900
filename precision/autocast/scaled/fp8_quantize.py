"""FP8 quantization: the two formats, power-of-two scales from an amax, and
amax histories (delayed scaling).

A tensor is quantized as ``f8(clip(x * s))`` with ``s`` a power of two chosen
from an absolute maximum (*amax*) so that the largest value lands near the
format's largest finite value. Per-tensor (one scale) or axis-wise (one scale
per slice along the axes a matmul contracts: a row of the activation, a column
of the weight, torchao's "rowwise" recipe). A power-of-two scale adds no
rounding of its own: the only error is FP8's.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["E4M3", "E5M2", "Histories", "amax", "scale_for", "quantize", "quantized", "quantized_along",
           "roll_history", "FP8_READ", "e4m3_read", "dequantized"]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
F32 = np.dtype(np.float32)
#: Scales stay within 2^±100: far inside float32, and past any amax a float32 tensor can hold usefully.
_MAX_EXPONENT = 100.0


class Histories(NamedTuple):
    """Amax histories (float32 ``[length]``, newest first) of one matmul's operands and gradient."""

    lhs: jax.Array
    rhs: jax.Array
    grad: jax.Array


def amax(x: jax.Array, axes: Sequence[int] | None = None) -> jax.Array:
    """The largest magnitude of ``x`` in float32 (NaN if ``x`` holds a NaN, inf if an inf):
    over the whole tensor, or over ``axes`` (kept, with size 1)."""
    if axes is not None:
        return jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True).astype(F32)
    return jnp.max(jnp.abs(x)).astype(F32) if x.size else jnp.zeros([], F32)


def scale_for(reference: jax.Array, current: jax.Array, dtype: np.dtype) -> jax.Array:
    """The power-of-two factor taking amax ``reference`` near ``dtype``'s largest finite value
    (elementwise: one scale per amax).

    1 when the reference is 0 (an all-zero tensor); NaN when the tensor's own
    amax ``current`` is not finite, so that every product it enters is NaN.
    """
    exponent = jnp.floor(jnp.log2(float(jnp.finfo(dtype).max)) - jnp.log2(reference))
    scale = jnp.exp2(jnp.clip(exponent, -_MAX_EXPONENT, _MAX_EXPONENT))
    scale = jnp.where(reference > 0, scale, 1.0)
    return jnp.where(jnp.isfinite(current), scale, jnp.nan).astype(F32)


def quantize(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    """``x * scale`` in ``dtype``, saturating at its largest finite value."""
    bound = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(F32) * scale, -bound, bound).astype(dtype)


def _reference(history: jax.Array | None, current: jax.Array) -> jax.Array:
    """The amax a scale is chosen from: the history's largest, or the tensor's own
    (current scaling, and delayed scaling's first step, when the history is empty)."""
    if history is None:
        return current
    recorded = jnp.max(history)
    return jnp.where(recorded > 0, recorded, current)


def quantized(x: jax.Array, history: jax.Array | None, dtype: np.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(``x`` in ``dtype``, the scale it was multiplied by, ``x``'s amax): one scale for
    the tensor, from its own amax or from ``history``'s largest."""
    current = amax(x)
    scale = scale_for(_reference(history, current), current, dtype)
    return quantize(x, scale, dtype), scale, current


#: The name of the sub-program quantizing a tensorwise, currently scaled FP8 operand: where
#: :func:`precision.read_dtypes` sees a param read in E4M3 (so FSDP can gather it in one byte).
FP8_READ = "fp8_e4m3_read"


def _fp8_e4m3_read(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return quantized(x, None, E4M3)


_fp8_e4m3_read.__name__ = FP8_READ
#: :func:`quantized` to E4M3 from ``x``'s own amax, as a named sub-program (:data:`FP8_READ`).
e4m3_read = jax.jit(_fp8_e4m3_read)


def dequantized(q: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    """``q / scale`` in ``dtype``: exact (an FP8 value over a power of two) wherever ``dtype``
    holds FP8's range, as float32 and bfloat16 do."""
    return (q.astype(F32) * (1.0 / scale)).astype(dtype)


def quantized_along(x: jax.Array, axes: Sequence[int], dtype: np.dtype) -> tuple[jax.Array, jax.Array]:
    """(``x`` in ``dtype``, its scales): one scale per slice along ``axes`` (the
    contracted axes of a matmul), from that slice's own amax; the scales have
    ``x``'s shape with ``axes`` of size 1."""
    current = amax(x, axes)
    scale = scale_for(current, current, dtype)
    return quantize(x, scale, dtype), scale


def roll_history(history: jax.Array, current: jax.Array) -> jax.Array:
    """``history`` with ``current`` recorded as its newest entry (the oldest dropped);
    a non-finite amax is not recorded: the history is returned unchanged."""
    rolled = jnp.roll(history, 1).at[0].set(current)
    return jnp.where(jnp.isfinite(current), rolled, history)
