"""Weights that are only read (a fine-tuned model's frozen base), stored in 8 or 4 bits.

A frozen weight is never updated, so it needs no code that rounds updates well
(:mod:`precision.quantized` does that for optimizer state): only a faithful copy,
read once per step. It is split into blocks of :data:`BLOCK` values (the weight
flattened), each with a float32 scale, its largest magnitude, and a code per value:

- ``int8``: ``round(127 * x / scale)``, symmetric: 1 + 4/64 bytes per value;
- ``nf4``: the index of the nearest of 16 levels placed at quantiles of a normal
  distribution scaled to [-1, 1] (QLoRA's NormalFloat, for normally distributed
  weights), two per byte: 0.5 + 4/64 bytes per value.

Models read :class:`QuantizedWeight` leaves as floating arrays: the policy's model
wrappers dequantize them where they are applied, inside the traced step, where XLA
fuses the dequantization into the cast that feeds each matmul; no dequantized copy is
stored. Under autocast each weight is read by a named sub-program (:func:`read_in_program`),
by which a matmul reading it finds its codes and dequantizes them again for its backward
pass (:mod:`precision.autocast.frozen_reads`); elsewhere :func:`dequantized`. Weights too
small to pay (biases, norms) stay floating: :func:`quantizable` says which.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from precision.block_codes import dequantize_blocks, is_block_codes, read_blocks
from precision.channel_weights import dequantize_channels, is_channel_int8, read_channels
from precision.normal_float import BLOCK, NF4_LEVELS, block_units

__all__ = ["BLOCK", "CODES", "QuantizedWeight", "quantizable", "quantize_weight", "dequantize_weight",
           "dequantized", "read_in_program", "READ", "is_quantized", "in_codes", "logical_size", "NF4_LEVELS"]

#: The codes a weight can be stored in.
CODES = ("int8", "nf4")
#: Weights with fewer values, or fewer than two dimensions, stay floating.
MIN_SIZE = 4096


@struct.dataclass
class QuantizedWeight:
    """A weight in blocks of :data:`BLOCK` codes (``int8``: int8 values; ``nf4``: uint8,
    two 4-bit level indices each) and their float32 scales."""

    codes: jax.Array
    scales: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    dtype: Any = struct.field(pytree_node=False)  # the weight's floating dtype when read
    code: str = struct.field(pytree_node=False)

    @property
    def size(self) -> int:
        """Values of the weight (not of its codes)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes it is stored in: its codes and their scales."""
        return int(np.size(self.codes)) * np.dtype(self.codes.dtype).itemsize + 4 * int(np.size(self.scales))


def quantizable(x: Any) -> bool:
    """Whether a weight is worth storing in codes: floating, a matrix or more, :data:`MIN_SIZE` values."""
    return jnp.issubdtype(x.dtype, jnp.floating) and len(x.shape) >= 2 and math.prod(x.shape) >= MIN_SIZE


def quantize_weight(x: jax.Array, code: str) -> QuantizedWeight:
    """``x`` in ``code`` (``"int8"`` or ``"nf4"``), rounded to nearest, block by block."""
    if code not in CODES:
        raise ValueError(f"quantize_weight: code {code!r}; valid: {', '.join(CODES)}")
    flat = jnp.asarray(x, jnp.float32).reshape(-1)
    pad = -flat.size % BLOCK
    blocks = jnp.pad(flat, (0, pad)).reshape(-1, BLOCK)
    scales = jnp.max(jnp.abs(blocks), axis=1)
    unit = blocks / jnp.where(scales > 0, scales, 1.0)[:, None]
    if code == "int8":
        codes = jnp.round(unit * 127).astype(jnp.int8)
    else:
        levels = jnp.asarray(NF4_LEVELS)
        index = jnp.argmin(jnp.abs(unit[..., None] - levels), axis=-1).astype(jnp.uint8)
        codes = index[:, 0::2] | (index[:, 1::2] << 4)
    return QuantizedWeight(codes, scales, tuple(x.shape), np.dtype(x.dtype), code)


def dequantize_weight(q: QuantizedWeight) -> jax.Array:
    """The weight ``q`` stores, in its floating dtype. Elementwise from the codes (no gather,
    no unpacked indices), so XLA computes it inside each op that reads it, as it does a cast:
    a step never holds a weight's dequantized values, or its unpacked 4-bit indices, whole."""
    unit, scales = block_units(q.codes, q.scales, q.code)
    values = (unit * scales[:, None]).reshape(-1)[:q.size]
    return values.reshape(q.shape).astype(q.dtype)


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is a :class:`QuantizedWeight` (an ``is_leaf`` for tree maps that see weights whole)."""
    return isinstance(x, QuantizedWeight)


def in_codes(x: Any) -> bool:
    """Whether ``x`` is a weight stored in codes: a :class:`QuantizedWeight`, a
    :class:`precision.ChannelInt8` or a :class:`precision.block_codes.BlockCodes` (an ``is_leaf``
    for tree maps that see such weights whole)."""
    return is_quantized(x) or is_channel_int8(x) or is_block_codes(x)


def dequantized(tree: Any) -> Any:
    """``tree`` with every weight stored in codes (:class:`QuantizedWeight`, :class:`precision.ChannelInt8`)
    read as its floating weight (other leaves as they are)."""
    if not any(in_codes(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=in_codes)):
        return tree
    return jax.tree_util.tree_map(
        lambda x: dequantize_weight(x) if is_quantized(x) else dequantize_channels(x) if is_channel_int8(x)
        else dequantize_blocks(x) if is_block_codes(x) else x, tree, is_leaf=in_codes)


#: The name of the sub-program that dequantizes one weight in a traced program (:func:`read_in_program`).
READ = "quantized_weight_read"


def _quantized_weight_read(q: QuantizedWeight) -> jax.Array:
    values = dequantize_weight(q)
    half = values.dtype in (jnp.bfloat16, jnp.float16)
    return values.astype(jnp.float32) if half else values  # exact: the program is traced in float32


_quantized_weight_read.__name__ = READ
_read = jax.jit(_quantized_weight_read)


def read_in_program(tree: Any) -> Any:
    """:func:`dequantized`, each weight by a sub-program named :data:`READ` (a
    :class:`precision.ChannelInt8`: :data:`precision.channel_weights.CHANNEL_READ`; a
    :class:`precision.block_codes.BlockCodes`: one of :data:`precision.block_codes.BLOCK_READS`) and widened to
    float32 (exactly: autocast traces programs in float32 and casts where they compute): how
    autocast's programs read a frozen base, so that a matmul reading a weight finds its codes."""
    if not any(in_codes(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=in_codes)):
        return tree
    return jax.tree_util.tree_map(lambda x: _read(x) if is_quantized(x) else read_channels(x) if is_channel_int8(x)
                                  else read_blocks(x) if is_block_codes(x) else x, tree, is_leaf=in_codes)


def logical_size(x: Any) -> int:
    """Values of a weight, stored in codes or not."""
    return x.size if is_quantized(x) else int(np.prod(np.shape(x), dtype=np.int64))
