"""Weights laid out for a decode step: each matmul's weight stored with the axes it contracts last.

At one token a step a matmul multiplies a vector by a weight, and XLA's GPU compiler makes
it an elementwise product and a reduction over the contracted axes. Over a weight's minor
(last) axes, that is one kernel reading the weight once. Over its major axes (a Flax
``Dense`` kernel is ``(in, out)``, contracted over ``in``) XLA writes the whole product
before reducing it wherever the weight has as many inputs as outputs or more: the weight's
bytes three times (an H100 program of GPT-2-small's shape: 14.2 MB moved for the 4.7 MB of
a 3,072 x 768 kernel, in two kernels; 4.7 MB and one kernel for the same weight stored
``(out, in)``). So serving stores such a weight transposed, its contracted axes last
(:class:`ContractedLast`), and the jitted step reads it back in the model's layout: a
transpose XLA folds into the matmul, which then contracts the stored weight's minor axes.
A Hugging Face GPT-2 ``Conv1D`` kernel, ``(out, in)`` already, is left as it is.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct

from precision.block_codes import dequantize_blocks, is_block_codes
from precision.channel_weights import ChannelInt8, dequantize_channels, is_channel_int8
from precision.quantized_weights import dequantize_weight, in_codes, is_quantized

__all__ = ["ContractedLast", "laid_out", "is_stored_weight", "read_weight", "in_model_layout", "stored_bytes"]

Flat = dict[tuple[str, ...], Any]


@struct.dataclass
class ContractedLast:
    """A weight stored with its axes in ``order`` (the axes its matmuls contract last): an
    array or a :class:`precision.ChannelInt8` (its codes and scales transposed alike)."""

    stored: Any
    order: tuple[int, ...] = struct.field(pytree_node=False)


def laid_out(flat: Flat, axes: Flat) -> Flat:
    """``flat`` (served weights, flattened) with each weight only matmuls read
    (``axes``: :func:`precision.contracted_axes` of each, None for the rest) stored as a
    :class:`ContractedLast` where the axes they contract are not already its last ones."""
    out = dict(flat)
    for path, value in flat.items():
        contracted = axes.get(path)
        if not contracted:
            continue
        rank = len(value.shape)
        order = tuple([a for a in range(rank) if a not in contracted] + sorted(contracted))
        if order != tuple(range(rank)):
            out[path] = ContractedLast(_transposed(value, order), order)
    return out


def _transposed(value: Any, order: tuple[int, ...]) -> Any:
    """``value`` with its axes in ``order``, copied on the host (no program compiled per shape)."""
    if is_channel_int8(value):
        return ChannelInt8(_transposed(value.codes, order), _transposed(value.scales, order), value.dtype)
    return jnp.asarray(np.ascontiguousarray(np.transpose(np.asarray(value), order)))


def is_stored_weight(x: Any) -> bool:
    """An ``is_leaf`` for tree maps that see served weights whole (laid out, int8, or in the
    blocks of a stored base: :class:`precision.QuantizedWeight`, laid out or not)."""
    return isinstance(x, ContractedLast) or in_codes(x)


def read_weight(x: Any, dtype: Any = None) -> Any:
    """A served weight as the model reads it: int8 or a stored base's codes dequantized (in
    ``dtype``; default its own), transposed back to the model's layout; any other leaf as it is."""
    x = in_model_layout(x)
    if is_quantized(x):
        return dequantize_weight(x if dtype is None else x.replace(dtype=np.dtype(dtype)))
    if is_block_codes(x):
        return dequantize_blocks(x, dtype)
    return dequantize_channels(x, dtype) if is_channel_int8(x) else x


def in_model_layout(x: Any) -> Any:
    """A served weight in the model's layout, an int8 one still in codes (transposed back alike:
    the model's autocast reads it inside the matmul); any other leaf as it is."""
    if not isinstance(x, ContractedLast):
        return x
    back = lambda a: jnp.transpose(a, np.argsort(x.order))  # noqa: E731
    if is_channel_int8(x.stored):
        return ChannelInt8(back(x.stored.codes), back(x.stored.scales), x.stored.dtype)
    return back(x.stored)


def stored_bytes(x: Any) -> int:
    """Bytes a served weight is stored in (int8 codes and their scales; an array's own)."""
    if isinstance(x, ContractedLast):
        return stored_bytes(x.stored)
    if in_codes(x):
        return x.nbytes
    return int(np.size(x)) * np.dtype(x.dtype).itemsize

