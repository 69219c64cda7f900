"""Int8 quantization: symmetric, a scale per slice, from the tensor itself.

A tensor is quantized along the axes a product contracts: each slice (a row
of the activation, a column of the weight) gets its own scale, ``absmax /
127`` (current scaling: this step's values, nothing kept), and its values are
``round(x / scale)`` in ``[-127, 127]`` (the symmetric range: -128 is never
made, so negation is exact). Rounding is to nearest, or stochastic: ``floor(x
/ scale + u)`` with ``u`` uniform in [0, 1), unbiased in expectation (the
gradient's option). An all-zero slice has scale 1; a non-finite one has scale
NaN, so every product it enters is NaN (never clipped into a finite wrong
step: the loss-scale machinery skips such a step).
"""

from __future__ import annotations

import contextvars
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precision.rounding_bits import hashed_bits

__all__ = ["INT8", "INT32", "QMAX", "scales_along", "quantize_int8", "quantized_along", "stochastic_noise",
           "saturated_share", "zero_share", "RECORDING", "record"]

INT8 = np.dtype(np.int8)
INT32 = np.dtype(np.int32)
F32 = np.dtype(np.float32)
#: The largest int8 magnitude a value is scaled to (symmetric: -127..127).
QMAX = 127.0


def scales_along(x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """``absmax / 127`` of each slice of ``x`` along ``axes`` (float32, ``x``'s shape with
    ``axes`` of size 1): 1 for an all-zero slice, NaN for a non-finite one."""
    amax = jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True).astype(F32)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan).astype(F32)


def quantize_int8(x: jax.Array, scale: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    """``x / scale`` rounded to int8 in [-127, 127]: to nearest, or, given ``noise``
    (uniform in [0, 1), ``x``'s shape), stochastically (``floor(x / scale + noise)``)."""
    scaled = x.astype(F32) / scale
    rounded = jnp.round(scaled) if noise is None else jnp.floor(scaled + noise)
    return jnp.clip(rounded, -QMAX, QMAX).astype(INT8)


def quantized_along(x: jax.Array, axes: Sequence[int], noise: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """(``x`` in int8, its scales): one scale per slice along ``axes`` (see :func:`scales_along`)."""
    scale = scales_along(x, axes)
    return quantize_int8(x, scale, noise), scale


def stochastic_noise(x: jax.Array, salt: int = 0) -> jax.Array:
    """Uniform [0, 1) noise of ``x``'s shape for stochastic rounding, from a key folded
    from ``x``'s own bits (their wrapping sum) and ``salt``: the same tensor gets the
    same noise, so a step is deterministic and a resumed run repeats it bit for bit,
    with no key to carry in the train state. The bits are hashed from each value's index
    (:func:`precision.rounding_bits.hashed_bits`: a few integer operations a value, where
    threefry's were about a hundred), 24 of them a value: every float32 in [0, 1) a
    multiple of 2^-24, each as likely."""
    bits = lax.bitcast_convert_type(x.astype(F32), jnp.uint32)
    seed = jnp.sum(bits, dtype=jnp.uint32) ^ jnp.uint32(salt & 0xFFFFFFFF)
    key = jax.random.fold_in(jax.random.key(0x1A7), seed)
    return (hashed_bits(key, x.shape) >> 8).astype(F32) * jnp.float32(2.0 ** -24)


def saturated_share(x: jax.Array, scale: jax.Array) -> jax.Array:
    """The share of ``x``'s values that int8 at ``scale`` holds at its largest magnitude
    (127): with absmax scales, the slices' largest values and what rounds to them."""
    return jnp.mean((jnp.abs(x.astype(F32) / scale) >= QMAX - 0.5).astype(F32))


def zero_share(x: jax.Array, scale: jax.Array) -> jax.Array:
    """The share of ``x``'s nonzero values that int8 at ``scale`` rounds to zero (below half
    a step): what the quantization loses outright."""
    x = x.astype(F32)
    nonzero = x != 0
    lost = nonzero & (jnp.abs(x / scale) < 0.5)
    return jnp.sum(lost.astype(F32)) / jnp.maximum(jnp.sum(nonzero.astype(F32)), 1.0)


#: While the doctor records (:mod:`precision.doctor.int8_check`), the list each int8 product
#: traced reports its operands' shares to, at run time: ``(module, pass, operand, zero share,
#: saturated share)``. None (the default): nothing recorded, nothing added to the program.
RECORDING: contextvars.ContextVar = contextvars.ContextVar("int8_recording", default=None)


def record(where: str, pass_: str, operand: str, x: jax.Array, scale: jax.Array) -> None:
    """Reports ``x``'s shares rounded to zero and saturated at ``scale`` to the active recording
    (a ``jax.debug.callback``; nothing when none is active or ``where`` is empty)."""
    sink = RECORDING.get()
    if sink is None or not where:
        return
    jax.debug.callback(lambda zero, saturated: sink.append((where, pass_, operand, float(zero), float(saturated))),
                       zero_share(x, scale), saturated_share(x, scale))
