"""QLoRA's NormalFloat4 levels, and the blocks a weight's codes come in.

A weight stored in 4 bits (:mod:`precision.quantized_weights`) is, per block of :data:`BLOCK`
values with one float32 scale, the index of the nearest of 16 levels placed at quantiles of a
normal distribution scaled to [-1, 1] (QLoRA, section 3): :data:`NF4_LEVELS`. Both the stored
form and its layout for decoding (:mod:`precision.block_codes`) read them here.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BLOCK", "NF4_LEVELS", "nf4_levels", "nibbles", "block_units"]

#: Values per block of codes (one float32 scale each), as QLoRA's.
BLOCK = 64


def _normal_float_levels(bits: int = 4) -> np.ndarray:
    """2**bits levels in [-1, 1], 0 among them, at quantiles of N(0, 1): one more
    positive level than negative ones (QLoRA, section 3), normalised by the largest."""
    normal = statistics.NormalDist()
    offset = 0.5 * (1 / 32 + 1 / 30)  # the outermost quantile kept away from infinity
    positive = [normal.inv_cdf(p) for p in np.linspace(1 - offset, 0.5, 2 ** (bits - 1) + 1)[:-1]]
    negative = [-normal.inv_cdf(p) for p in np.linspace(1 - offset, 0.5, 2 ** (bits - 1))[:-1]]
    levels = np.sort(np.array(positive + [0.0] + negative))
    return (levels / np.abs(levels).max()).astype(np.float32)


#: NormalFloat4's 16 levels, ascending, from -1 to 1.
NF4_LEVELS = _normal_float_levels()


def nf4_levels(index: jax.Array) -> jax.Array:
    """NormalFloat4's level of each index, by a tree of selects on its bits (elementwise, where a
    lookup in a table of 16 is a gather, which XLA computes into a buffer of its own)."""
    levels = [jnp.float32(v) for v in NF4_LEVELS]
    for bit in range(4):  # pairs of candidates narrowed by bit 0, then bit 1...
        set_ = (index >> bit) & 1 == 1
        levels = [jnp.where(set_, hi, lo) for lo, hi in zip(levels[0::2], levels[1::2])]
    return levels[0]


def nibbles(codes: jax.Array, axis: int = -1) -> jax.Array:
    """nf4 level indices of ``codes``, two per byte along ``axis`` (low nibble first), each byte
    read twice with a shift: a broadcast, not a concatenation."""
    axis = axis % codes.ndim
    shifts = jnp.array([0, 4], jnp.uint8).reshape((2,) + (1,) * (codes.ndim - 1 - axis))
    index = (jnp.expand_dims(codes, axis + 1) >> shifts) & 15
    shape = list(codes.shape)
    shape[axis] *= 2
    return index.reshape(shape)


def block_units(codes: jax.Array, scales: jax.Array, code: str, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Float32 units of ``codes`` (``int8`` values, or ``nf4`` levels two a byte along ``axis``) and
    the step each block's unit is worth (its scale over 127 for int8): the weight is their product.
    Elementwise (levels by a tree of selects, no gather), as XLA fuses it into what reads it."""
    if code == "int8":  # one product per value, by each block's step: no order for XLA to rearrange
        return codes.astype(jnp.float32), scales * np.float32(1 / 127)
    return nf4_levels(nibbles(codes, axis)), scales
