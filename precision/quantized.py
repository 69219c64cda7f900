"""8-bit optimizer state: block-wise quantized arrays with a floating 8-bit code.

An optimizer moment is split into blocks of :data:`BLOCK` values (of the array
flattened); each block keeps a float32 scale (its largest magnitude) and one
byte per value. The byte is a float8 E4M3 number (3 bits of mantissa, 4 of
exponent: a dynamic code, like bitsandbytes' dynamic quantization, whose
relative precision is the same for large and small values), taken of the
*signed square root* of the value: the second moment (squares of gradients)
spans twice the exponent range of the gradients, and the root brings it back
into the code's. Values are stored with stochastic rounding (an Adam second
moment grows by 0.1% of itself per step, below half a step of any 8-bit code:
rounded to nearest it would never move), from bits of a key in the state.

About 1.02 bytes per value (the scales add 4 / 256); arrays under
:data:`MIN_SIZE` values (norms, biases) are not worth blocking and are stored
in bfloat16 by :func:`precision.stored.stored_in`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from precision.rounding_bits import hashed_bits

__all__ = ["BLOCK", "MIN_SIZE", "Blockwise", "quantize", "dequantize"]

#: Values per block (one float32 scale each).
BLOCK = 256
#: Arrays with fewer values stay in 16 bits.
MIN_SIZE = 4096
_CODE = jnp.float8_e4m3fn
_CODE_MAX = float(jnp.finfo(_CODE).max)  # 448
_CODE_MANTISSA = int(jnp.finfo(_CODE).nmant)  # 3


@struct.dataclass
class Blockwise:
    """An array stored block-wise in 8 bits: ``codes`` (blocks x BLOCK, float8 E4M3 of the
    scaled signed square roots), ``scales`` (one float32 per block), its ``shape``."""

    codes: jax.Array
    scales: jax.Array
    shape: tuple = struct.field(pytree_node=False, default=())


def _stochastic_code(x: jax.Array, key: jax.Array) -> jax.Array:
    """float32 values within the code's range rounded to it up or down at random (unbiased
    where the code is normal: random bits below its mantissa, then truncation)."""
    drop = 23 - _CODE_MANTISSA
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = hashed_bits(key, x.shape) >> (32 - drop)
    kept = jnp.uint32(0xFFFFFFFF ^ ((1 << drop) - 1))
    return jax.lax.bitcast_convert_type((bits + noise) & kept, jnp.float32).astype(_CODE)


def quantize(x: jax.Array, key: jax.Array) -> Blockwise:
    """``x`` (float) as 8-bit blocks, stochastically rounded from ``key``."""
    flat = jnp.asarray(x, jnp.float32).reshape(-1)
    root = jnp.sign(flat) * jnp.sqrt(jnp.abs(flat))
    blocks = jnp.pad(root, (0, (-flat.size) % BLOCK)).reshape(-1, BLOCK)
    peak = jnp.max(jnp.abs(blocks), axis=1)
    scales = jnp.where(peak > 0, peak / _CODE_MAX, 1.0)
    codes = _stochastic_code(jnp.clip(blocks / scales[:, None], -_CODE_MAX, _CODE_MAX), key)
    return Blockwise(codes, scales, tuple(np.shape(x)))


def dequantize(b: Blockwise) -> jax.Array:
    """The float32 array ``b`` stores."""
    root = b.codes.astype(jnp.float32) * b.scales[:, None]
    size = int(np.prod(b.shape, dtype=np.int64))
    return (jnp.sign(root) * jnp.square(root)).reshape(-1)[:size].reshape(b.shape)


def stored_bytes(b: Any) -> int:
    """Bytes of a :class:`Blockwise` (codes and scales)."""
    return int(b.codes.size) * 1 + int(b.scales.size) * 4
