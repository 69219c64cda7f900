"""The order a fused matmul's parts are kept in over ``tensor`` devices.

A fused kernel (q, k and v in one, as GPT-2's ``c_attn``) has ``parts`` equal parts along
its output features. Split contiguously over ``T`` devices, a device would hold all of q
and none of v; reordered ``(parts, T, n) -> (T, parts, n)`` each device's contiguous block
holds its ``n`` columns of every part, so the matmul, and the heads each part makes, stay
on the device (:func:`interleaved`). The split of its result into parts reads them back
from that order (:func:`parts_of`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["interleaved", "deinterleaved", "parts_of"]


def interleaved(x: Any, dim: int, parts: int, tensor: int) -> Any:
    """``x`` along ``dim`` (``parts`` equal parts) reordered ``(parts, T, n) -> (T, parts, n)``."""
    shape = x.shape
    n = shape[dim] // (parts * tensor)
    y = x.reshape(shape[:dim] + (parts, tensor, n) + shape[dim + 1:])
    return jnp.swapaxes(y, dim, dim + 1).reshape(shape)


def deinterleaved(x: Any, dim: int, parts: int, tensor: int) -> Any:
    """:func:`interleaved` undone: ``(T, parts, n) -> (parts, T, n)``."""
    shape = x.shape
    n = shape[dim] // (parts * tensor)
    y = x.reshape(shape[:dim] + (tensor, parts, n) + shape[dim + 1:])
    return jnp.swapaxes(y, dim, dim + 1).reshape(shape)


def parts_of(x: Any, axis: int, parts: int, tensor: int) -> list:
    """The ``parts`` of ``x`` (held :func:`interleaved` along ``axis``), each in its own order."""
    shape = x.shape
    n = shape[axis] // (parts * tensor)
    y = x.reshape(shape[:axis] + (tensor, parts, n) + shape[axis + 1:])
    return [lax.index_in_dim(y, i, axis + 1, keepdims=False).reshape(shape[:axis] + (tensor * n,) + shape[axis + 1:])
            for i in range(parts)]
