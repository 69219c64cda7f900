"""A frozen weight's codes laid out for decoding: each code read once by a decode step's product.

A :class:`precision.QuantizedWeight` holds a 2-D weight's codes in blocks of 64 of the weight
flattened, a scale each. Read as written, ``x . dequantize(codes)``, a decode step's
matrix-vector product made XLA write the weight dequantized and read it again (an H100 program
of a 4,096 x 4,096 nf4 weight at batch 1: 76.8 MB moved in three kernels, for 9.4 MB of codes
and scales). The scales vary along the contracted axis, so they cannot be applied to the product
as a weight-only int8 one's are (:mod:`precision.channel_weights`). Written as one sum of
``x * S * L`` (``L`` the codes' levels, ``S`` their block's scale), XLA computes the product in
one kernel that reads each code once (the same weight: 9.5 MB, one kernel), for either layout
a matmul reads a weight in:

- ``(in, out)``, contracted on ``in`` (a Flax ``Dense`` kernel), ``out`` a multiple of 64: a
  block is 64 outputs of one input, ``y[b, j] = sum_i x[i] * S[b, i] * L[b, j, i]``; the codes
  are laid out ``[out / 64, codes of a block, in]`` and the scales ``[out / 64, in]``, the
  summed axis last;
- ``(out, in)``, contracted on ``in`` (a Hugging Face GPT-2 ``Conv1D`` kernel), ``in`` a
  multiple of 64: a block is 64 inputs of one output, ``y[o] = sum_(c, i) x[c, i] * S[o, c] *
  L[o, c, i]``; the codes ``[out, in / 64, codes of a block]``, as stored.

:class:`BlockCodes` holds the codes and scales of the :class:`QuantizedWeight` it is made from,
only reordered (its weight bit for bit). Under autocast a model reads one by a sub-program named
in :data:`BLOCK_READS`, by which a matmul reading it with at most :data:`FEW_ROWS` rows of input
(decoding) computes the sum above (:mod:`precision.autocast.frozen_reads`); with more (a
prompt) it reads the weight dequantized, as it would the :class:`QuantizedWeight`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from precision.normal_float import BLOCK, NF4_LEVELS, block_units, nibbles

__all__ = ["BlockCodes", "block_codes", "dequantize_blocks", "dequantize_rows", "block_product", "is_block_codes",
           "BLOCK_READS", "read_blocks", "FEW_ROWS"]

#: Rows of input up to which a matmul reads a :class:`BlockCodes` weight in its codes
#: (:func:`block_product`), past which it dequantizes the weight for a GEMM. The sum runs on the
#: vector units, 2 FLOPs per value per row: by an H100's datasheet (67 TFLOP/s of float32, 3.35
#: TB/s) it keeps pace with streaming the 0.56-byte codes up to ~6 rows and costs less than the
#: dequantized weight's ~8x the codes' bytes up to ~40. An estimate, not a measurement.
FEW_ROWS = 16


@struct.dataclass
class BlockCodes:
    """A 2-D weight contracted on axis ``contracted`` (0: ``(in, out)``, 1: ``(out, in)``) as the
    ``codes`` and float32 ``scales`` of its :class:`QuantizedWeight` (``code``: nf4, two levels a
    byte; int8), laid out as the module's docstring says, read in ``dtype``."""

    codes: jax.Array
    scales: jax.Array
    dtype: Any = struct.field(pytree_node=False)
    code: str = struct.field(pytree_node=False)
    contracted: int = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, int]:
        if self.contracted == 0:
            return int(self.codes.shape[2]), int(self.codes.shape[0]) * BLOCK
        return int(self.codes.shape[0]), int(self.codes.shape[1]) * BLOCK

    @property
    def nbytes(self) -> int:
        return int(np.size(self.codes)) * np.dtype(self.codes.dtype).itemsize + 4 * int(np.size(self.scales))


def is_block_codes(x: Any) -> bool:
    """Whether ``x`` is a :class:`BlockCodes` (an ``is_leaf`` for tree maps that see weights whole)."""
    return isinstance(x, BlockCodes)


def block_codes(q: Any, contracted: int) -> BlockCodes | None:
    """``q``'s (a :class:`precision.QuantizedWeight`) codes and scales laid out for products
    contracting its axis ``contracted`` (on the host: the same values, reordered), or None where
    its blocks are not whole runs of 64 along one row (not 2-D, or the minor axis not a multiple of 64)."""
    if len(q.shape) != 2 or q.shape[1] % BLOCK or contracted not in (0, 1):
        return None
    rows, blocks = q.shape[0], q.shape[1] // BLOCK
    codes = np.asarray(q.codes).reshape(rows, blocks, -1)
    scales = np.asarray(q.scales, np.float32).reshape(rows, blocks)
    if contracted == 0:
        codes, scales = codes.transpose(1, 2, 0), scales.T
    return BlockCodes(jnp.asarray(np.ascontiguousarray(codes)), jnp.asarray(np.ascontiguousarray(scales)),
                      np.dtype(q.dtype), q.code, contracted)


def dequantize_blocks(b: BlockCodes, dtype: Any = None) -> jax.Array:
    """The weight ``b`` stores, in the model's layout, in ``dtype`` (default: its own): the values
    of its :class:`QuantizedWeight`, bit for bit."""
    if b.contracted == 0:
        unit, steps = block_units(b.codes, b.scales, b.code, 1)
        values = (unit * steps[:, None, :]).reshape(-1, unit.shape[2]).T
    else:
        unit, steps = block_units(b.codes, b.scales, b.code, 2)
        values = (unit * steps[..., None]).reshape(unit.shape[0], -1)
    return values.astype(dtype or b.dtype)


def dequantize_rows(codes: jax.Array, scales: jax.Array, code: str, rows: jax.Array) -> jax.Array:
    """Rows ``rows`` (indices, clipped into range) of the weight ``(out, in)`` in ``codes`` and
    ``scales`` (a :class:`BlockCodes`' leaves, contracted on axis 1), in float32: the values
    :func:`dequantize_blocks` computes for them, from their codes alone."""
    picked = jnp.take(codes, rows, axis=0, mode="clip"), jnp.take(scales, rows, axis=0, mode="clip")
    unit, steps = block_units(*picked, code, 2)
    return (unit * steps[..., None]).reshape(unit.shape[0], -1)


def block_product(x: jax.Array, codes: jax.Array, scales: jax.Array, code: str, contracted: int, dtype: Any
                  ) -> jax.Array:
    """``x @ W`` (``x`` ``[..., in]``, float32 result ``[..., out]``) for ``W`` in ``codes`` and
    ``scales`` (a :class:`BlockCodes`' leaves, contracted on ``contracted``): one sum of
    ``x * S * L``, ``x`` and the levels in ``dtype``, multiplied and summed in float32."""
    axis = 1 if contracted == 0 else 2
    if code == "int8":
        levels, steps = codes.astype(dtype), scales * np.float32(1 / 127)
    else:  # a lookup in the 16 levels: XLA fuses it into the sum (a tree of selects, it did not: 768 x 768 at
        #  batch 1 on an H100 wrote the products in float32, 15x the codes' bytes)
        levels, steps = jnp.asarray(NF4_LEVELS, dtype)[nibbles(codes, axis)], scales
    x = x.astype(dtype).astype(jnp.float32)
    if contracted == 0:  # y[b, j] = sum_i x[i] S[b, i] L[b, j, i]
        y = jnp.sum(x[..., None, None, :] * steps[:, None, :] * levels, axis=-1)
    else:  # y[o] = sum_(c, i) x[c, i] S[o, c] L[o, c, i]
        blocks = x.reshape(*x.shape[:-1], 1, steps.shape[1], BLOCK)
        y = jnp.sum(blocks * steps[..., None] * levels, axis=(-2, -1))
    return y.reshape(*y.shape[:-2], -1) if contracted == 0 else y


#: The names of the sub-programs that dequantize a :class:`BlockCodes`, by its contracted axis.
BLOCK_READS = {0: "block_codes_read_contracting_0", 1: "block_codes_read_contracting_1"}


def _reader(name: str) -> Any:
    def read(b: BlockCodes) -> jax.Array:
        values = dequantize_blocks(b)
        return values.astype(jnp.float32) if values.dtype in (jnp.bfloat16, jnp.float16) else values

    read.__name__ = name
    return jax.jit(read)


_READERS = {axis: _reader(name) for axis, name in BLOCK_READS.items()}


def read_blocks(b: BlockCodes) -> jax.Array:
    """``b`` dequantized by a sub-program named ``BLOCK_READS[b.contracted]``, widened to float32
    (exactly: autocast traces in float32), as autocast's programs read it (see the module's docstring)."""
    return _READERS[b.contracted](b)
