"""Weight-only int8 for serving: one scale per output channel, dequantized into the matmul's operand.

Decoding reads every weight once per token, so its time is the bytes of the weights:
int8 halves bfloat16's. Each weight is stored as int8 codes and a float32 scale per
slice along the axes its matmuls do not contract (:func:`precision.contracted_axes`:
a ``Dense`` kernel's output columns, a tied embedding's rows), ``round(127 * w / max|w|)``
over each slice. Under autocast a model reads it by a sub-program named :data:`CHANNEL_READ`
(:func:`read_channels`), by which a matmul reading it finds its codes and scales and
multiplies the codes, ``(x . codes) * scales`` (:mod:`precision.autocast.frozen_reads`): the
product reads each code once, in int8, where ``x . (codes * scales)`` made XLA write the
dequantized weight in bfloat16 and read it again (an H100 program of a 4,096 x 14,336 weight
at batch 1: 293.7 MB in two kernels, 58.8 MB in one).

Unlike :class:`precision.QuantizedWeight` (a frozen LoRA base in blocks of 64 of the
flattened weight), the scales here follow the matmul, so a weight's rounding is that of
each output it makes (the per-channel weight-only int8 of LLM.int8's baseline, MaxText's
``quantization=int8`` weights).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = ["ChannelInt8", "quantize_channels", "dequantize_channels", "is_channel_int8", "CHANNEL_READ",
           "read_channels"]


@struct.dataclass
class ChannelInt8:
    """A weight as int8 ``codes`` (its shape) and float32 ``scales`` (its shape with 1 on
    each contracted axis): the weight is ``codes * scales``, read in ``dtype``."""

    codes: jax.Array
    scales: jax.Array
    dtype: Any = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return int(np.size(self.codes)) + 4 * int(np.size(self.scales))


def quantize_channels(w: Any, contracted: tuple[int, ...], dtype: Any = jnp.bfloat16) -> ChannelInt8:
    """``w`` in int8, one scale per slice along the axes not in ``contracted``, rounded to
    nearest; read back in ``dtype``."""
    x = jnp.asarray(w, jnp.float32)
    peak = jnp.max(jnp.abs(x), axis=tuple(contracted), keepdims=True)
    scales = jnp.where(peak > 0, peak, 1.0) / 127
    codes = jnp.clip(jnp.round(x / scales), -127, 127).astype(jnp.int8)
    return ChannelInt8(codes, scales, np.dtype(dtype))


def dequantize_channels(q: ChannelInt8, dtype: Any = None) -> jax.Array:
    """The weight ``q`` stores, in ``dtype`` (default: its own): ``codes * scales``."""
    return (q.codes.astype(jnp.float32) * q.scales).astype(dtype or q.dtype)


def is_channel_int8(x: Any) -> bool:
    """Whether ``x`` is a :class:`ChannelInt8` (an ``is_leaf`` for tree maps that see weights whole)."""
    return isinstance(x, ChannelInt8)


#: The name of the sub-program that dequantizes a :class:`ChannelInt8` in a traced program.
CHANNEL_READ = "channel_int8_read"


def _channel_int8_read(q: ChannelInt8) -> jax.Array:
    values = dequantize_channels(q)
    return values.astype(jnp.float32) if values.dtype in (jnp.bfloat16, jnp.float16) else values


_channel_int8_read.__name__ = CHANNEL_READ
read_channels = jax.jit(_channel_int8_read)
read_channels.__doc__ = """``q`` dequantized by a sub-program named :data:`CHANNEL_READ`, widened to float32
(exactly: autocast traces in float32), as autocast's programs read it (see the module's docstring)."""
