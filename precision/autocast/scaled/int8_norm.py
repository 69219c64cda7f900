"""A layer or RMS norm before an int8 product, applied by the product's own kernels.

A transformer reads every norm's result with a projection (the query, key and
value's; the MLP's first). In a bf16 step on a TPU XLA fuses the normalization into
the matmul that reads it, and its backward into the input gradient's: they cost
nothing of their own. An int8 product's kernels are Pallas calls, which XLA fuses
nothing into, so there each norm took passes of its own: its statistics and 16-bit
result forward, its row sums, its input's gradient and its params' sums backward,
2.5 ms a layer (two norms) of GPT-2 small's modeled v5e step in ``mixed_int8``,
where bf16's take 0.8. Instead the product reads the norm's input ``x`` and normalizes
each row block itself (:mod:`.int8_tpu`): its row kernel holds whole rows, and the
weight-gradient kernel's token tiles do too where they span the row. Backward, the
input gradient's row kernel multiplies ``dy . wᵀ`` through the norm's derivative
(the whole row is in its block) before its one rounding, and sums the scale's and
offset's gradients over its rows.

:class:`RowNorm` is the norm as :mod:`precision.autocast.norm_pattern` found it
(``(x - mean) * rsqrt(var + eps) * scale + offset`` over the last axis, or ``x *
rsqrt(mean(x²) + eps) * scale``), computed in float32 on any block of whole rows.
Its backward is the closed form :mod:`precision.autocast.norm_fusion` gives the
norm: one row reduction (both sums) for the input's gradient, the params' as
column sums.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from precision.autocast.norm_pattern import Norm

__all__ = ["RowNorm", "Normalized", "row_norm"]


@dataclasses.dataclass(frozen=True, eq=False)
class RowNorm:
    """A layer norm (``centred``) or an RMS norm over the last axis, with a scale and/or an offset (the
    params, in that order, each broadcast along the rows): called on a float32 block of whole rows and
    its params' ``(1, K)`` (or ``(K,)``) values, it makes the normalized block in float32. Hashed by
    identity: a static argument of the int8 product's derivative."""

    eps: float
    centred: bool
    scale: bool
    offset: bool
    row_wise = True  # its values need a row's every column (a block of whole rows)
    transcendentals = 0  # one rsqrt a row: nothing beside a row's columns

    @property
    def params(self) -> int:
        """How many params it reads after ``x``."""
        return int(self.scale) + int(self.offset)

    def __call__(self, x: jax.Array, *params: jax.Array) -> jax.Array:
        y = self._standardized(x)[0]
        scale, offset = self._split(params)
        y = y if scale is None else y * scale
        return y if offset is None else y + offset

    def backward(self, x: jax.Array, d_out: jax.Array, *params: jax.Array) -> tuple[jax.Array, ...]:
        """``(x's gradient, each param's)`` from ``d_out`` (all float32; a param's summed over the rows,
        shaped as given), in closed form: ``rstd * (g - mean(g) - xhat * mean(g * xhat))`` with
        ``g = d_out * scale`` (no ``mean(g)`` for an RMS norm), the scale's ``sum(d_out * xhat)``,
        the offset's ``sum(d_out)``."""
        xhat, rstd = self._standardized(x)
        scale, offset = self._split(params)
        g = d_out if scale is None else d_out * scale
        n = x.shape[-1]
        inner = g - xhat * (jnp.sum(g * xhat, axis=-1, keepdims=True) / n)
        inner = inner - jnp.sum(g, axis=-1, keepdims=True) / n if self.centred else inner
        rows = tuple(range(x.ndim - 1))
        grads = [rstd * inner]
        if scale is not None:
            grads.append(jnp.sum(d_out * xhat, axis=rows).reshape(scale.shape))
        if offset is not None:
            grads.append(jnp.sum(d_out, axis=rows).reshape(offset.shape))
        return tuple(grads)

    def _standardized(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(``xhat``, ``rstd``): the variance in one pass over the row, ``E[x²] - E[x]²`` (clamped at 0),
        as Flax's ``LayerNorm`` computes it."""
        n = x.shape[-1]
        squares = jnp.sum(x * x, axis=-1, keepdims=True) / n
        if not self.centred:
            rstd = jax.lax.rsqrt(squares + self.eps)
            return x * rstd, rstd
        mean = jnp.sum(x, axis=-1, keepdims=True) / n
        rstd = jax.lax.rsqrt(jnp.maximum(squares - mean * mean, 0.0) + self.eps)
        return (x - mean) * rstd, rstd

    def _split(self, params: tuple) -> tuple[Any, Any]:
        """(scale or None, offset or None) from the params as given."""
        rest = list(params)
        return (rest.pop(0) if self.scale else None), (rest.pop(0) if self.offset else None)


@dataclasses.dataclass(frozen=True)
class Normalized:
    """How a value was made by a norm an int8 product may apply itself: the :class:`RowNorm`, the Val it
    normalized and its params' Vals (:attr:`precision.autocast.values.Val.normalized`)."""

    norm: RowNorm
    x: Any
    params: tuple


def row_norm(norm: Norm) -> RowNorm | None:
    """The :class:`RowNorm` computing ``norm`` (:class:`.norm_pattern.Norm`), or None where it is not one
    a product's kernels can apply to their rows: normalized over another axis than the last (a BatchNorm),
    its statistics read elsewhere, a param that varies along more than the last axis."""
    shape = tuple(norm.x.aval.shape)
    if len(shape) < 2 or tuple(norm.axes) != (len(shape) - 1,) or norm.stats_out:
        return None
    for param in (norm.scale, norm.offset):
        if param is None:
            continue
        dims = tuple(param.aval.shape)
        if not dims or dims[-1] != shape[-1] or any(d != 1 for d in dims[:-1]) or len(dims) > len(shape):
            return None
    return RowNorm(float(norm.eps), norm.mean is not None, norm.scale is not None, norm.offset is not None)
