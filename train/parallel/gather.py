"""FSDP's gathers: a split param whole (over ``fsdp``) where the model reads it, cast to the
dtype the model reads it in on each shard first, and its gradient handed back split.

A narrower gather still hands the model an array of the param's dtype (holding the narrow
values, which the model casts back exactly where it reads them). The derivative passes the
cotangent through unrounded and pinned to the param's stored layout: XLA's partitioner then
sums each device's part of a weight gradient straight into the device's own slice (a
reduce-scatter on a GPU or TPU), never the whole gradient on every device first (a
whole-array all-reduce, twice the bytes, whenever anything reads the whole sum before the
slice).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from precision.autocast.scaled.fp8_quantize import E4M3, dequantized, e4m3_read

__all__ = ["gather"]


def gather(x: Any, dtype: np.dtype, used: NamedSharding, stored: NamedSharding,
           order: tuple[Callable, Callable] | None = None) -> Any:
    """``x`` (laid out as ``stored``) in the layout the model ``used`` it in (whole over
    ``fsdp``; still split over ``tensor`` where the plan splits it), gathered in ``dtype``
    (cast on each shard first); its cotangent comes back in ``stored``'s layout.

    ``order``: ``(reorder, undo)``: a fused matmul's kernel handed over in the order that
    keeps each ``tensor`` device's part of every part together
    (:mod:`train.parallel.tensor.parts`), reordered after the cast (moved in ``dtype``)."""
    reorder, undo = order or (None, None)
    if x.dtype == dtype and reorder is None:
        return _whole(x, used, stored)
    if dtype == E4M3:  # quantized with the whole array's scale, the model handed its dequantized values
        def quantized(x):
            q, scale = e4m3_read(x)[:2]
            return (q if reorder is None else reorder(q)), scale

        return _narrow_gather(x, quantized, lambda q: dequantized(*q, x.dtype), used, stored, undo)
    return _narrow_gather(x, _then(lambda x: x.astype(dtype), reorder), lambda narrow: narrow.astype(x.dtype), used,
                          stored, undo)


def _then(first: Callable, second: Callable | None) -> Callable:
    return first if second is None else lambda x: second(first(x))


def _whole(x: Any, used: NamedSharding, stored: NamedSharding) -> Any:
    """``x`` in ``used``'s layout, its cotangent in ``stored``'s."""

    @jax.custom_vjp
    def whole(x):
        return jax.lax.with_sharding_constraint(x, used)

    whole.defvjp(lambda x: (whole(x), None), lambda _, g: (jax.lax.with_sharding_constraint(g, stored),))
    return whole(x)


def _narrow_gather(x: Any, narrow: Callable, widen: Callable, used: NamedSharding, stored: NamedSharding,
                   undo: Callable | None = None) -> Any:
    """``widen(gathered narrow(x))``: ``narrow`` on each shard, the all-gather of what it
    returns, ``widen`` after. Optimization barriers keep XLA from moving the narrowing
    after the gather (jax#23543). The cotangent passes through unrounded, in ``stored``'s layout.

    FP8 (E4M3, ``e4m3_read``): each shard is quantized with the scale of the whole array
    (its amax reduced across devices: every device makes the same bits), one byte per
    element crosses the wire, and the model's FP8 matmul quantizes the dequantized values
    to the same FP8 values (:mod:`precision.reads`)."""

    whole = NamedSharding(used.mesh, PartitionSpec())

    def laid_out(a):  # the payload's arrays (an FP8 read's scale is a scalar: whole)
        return jax.lax.with_sharding_constraint(a, used if np.ndim(a) == np.ndim(x) else whole)

    @jax.custom_vjp
    def gathered(x):
        payload = jax.lax.optimization_barrier(narrow(x))
        return widen(jax.lax.optimization_barrier(jax.tree_util.tree_map(laid_out, payload)))

    def backward(_, g):
        return (jax.lax.with_sharding_constraint(g if undo is None else undo(g), stored),)

    gathered.defvjp(lambda x: (gathered(x), None), backward)
    return gathered(x)
