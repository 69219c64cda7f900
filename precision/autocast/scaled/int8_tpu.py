"""Where an int8 matmul runs the fused Pallas kernels: a program lowered for one TPU.

:func:`forward` and :func:`backward` hold the XLA recipe (:mod:`.int8_matmul`) and
the kernels (:mod:`.int8_pallas`) side by side in a ``jax.lax.platform_dependent``:
a program lowered for a TPU runs the kernels, every other platform the recipe,
which stays exactly what it was (a CPU run, ``explain`` and the doctor see no
change). The kernel branch is chosen only when the program is lowered for one
device (as the Pallas flash attention is: :mod:`precision.autocast.tpu_flash`): a
Mosaic call is one custom call that XLA cannot split over devices, so a sharded
program keeps the recipe. Under ``vmap`` the recipe runs too.

The kernels take a plain matmul: the activation's last axis contracted with the
weight's first, no batch axes (:func:`kernel_sizes`), sizes their blocks take
(:func:`.int8_pallas.rows_blocks` and its siblings); anything else (a
convolution, attention's batched products, a small or odd shape) keeps the
recipe, and so does each backward product no kernel takes. The forward product
and the input's gradient are the recipe's values bit for bit; the weight's
gradient is tiled along the tokens (:func:`.int8_pallas.tiles_matmul`), and a
head's input gradient along its vocabulary (:func:`.int8_pallas.row_tiles_matmul`):
close, not the same. With stochastic rounding the backward keeps the recipe (its
noise is drawn by XLA), and while the doctor records, both passes do (it reads
the recipe's scales).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np

from precision.autocast.scaled.int8_pallas import (row_tiles_blocks, row_tiles_matmul, rows_blocks, rows_matmul,
                                                  tiles_blocks, tiles_matmul)
from precision.autocast.scaled.int8_quantize import quantized_along
from precision.autocast.tpu_flash import on_one_device

__all__ = ["kernel_sizes", "forward", "backward", "choose"]


def kernel_sizes(lhs: Any, rhs: Any, dims: Any) -> tuple[int, int, int] | None:
    """(M, K, N) of ``dot_general(lhs, rhs, dims)`` where it is a plain matmul the kernels may take
    (the lhs's last axis contracted with the rhs's first, no batch axes), else None."""
    (lhs_contract, rhs_contract), (lhs_batch, _) = dims
    if lhs_batch or tuple(lhs_contract) != (lhs.ndim - 1,) or tuple(rhs_contract) != (0,) or rhs.ndim < 2:
        return None
    return math.prod(lhs.shape[:-1]), lhs.shape[-1], math.prod(rhs.shape[1:])


def forward(recipe: Callable, lhs: jax.Array, rhs: jax.Array, dims: Any, out_dtype: Any, use_kernel: bool
            ) -> jax.Array:
    """``recipe(lhs, rhs)`` (the XLA recipe's product), or on one TPU (where ``use_kernel``: not while the
    doctor records, nor with ``precision.int8.tpu_kernels`` off) the row kernel computing the same."""
    sizes = kernel_sizes(lhs, rhs, dims) if use_kernel else None
    if sizes is None or not rows_blocks(*sizes, np.dtype(lhs.dtype).itemsize):
        return recipe(lhs, rhs)
    m, k, n = sizes

    def kernel(x, w):
        q_w, s_w = quantized_along(w.reshape(k, n), (0,))
        y = rows_matmul(x.reshape(m, k), q_w, s_w, out_dtype)
        return [y.reshape(*x.shape[:-1], *w.shape[1:])]

    return choose(kernel, lambda x, w: [recipe(x, w)], lhs, rhs)[0]


def backward(recipe: Callable, lhs: jax.Array, rhs: jax.Array, g: jax.Array, dims: Any, grad_dtypes: Any,
             use_kernels: bool) -> tuple[jax.Array, jax.Array]:
    """``recipe(lhs, rhs, g)`` (the recipe's two gradients in the operands' dtypes), or on one TPU the
    kernels: the input's gradient by the row kernel (``g``'s rows and ``w``'s rows quantized), the
    weight's by the tiled one; either by the recipe where its kernel cannot take the shapes (XLA drops
    the recipe's other product). ``grad_dtypes``: ((operand dtypes), (dtypes the products are made in))."""
    sizes = kernel_sizes(lhs, rhs, dims) if use_kernels else None
    if sizes is None:
        return recipe(lhs, rhs, g)
    m, k, n = sizes
    rows = rows_blocks(m, n, k, np.dtype(g.dtype).itemsize) or row_tiles_blocks(m, n, k)
    tiles = tiles_blocks(m, k, n, np.dtype(lhs.dtype).itemsize, np.dtype(g.dtype).itemsize)
    if not rows and not tiles:
        return recipe(lhs, rhs, g)
    (lhs_dtype, rhs_dtype), (lhs_grad, rhs_grad) = grad_dtypes

    def kernels(x, w, dy):
        by_recipe = None if rows and tiles else recipe(x, w, dy)
        if rows:
            dx = _input_gradient(dy.reshape(m, n), w.reshape(k, n), lhs_grad).reshape(x.shape).astype(lhs_dtype)
        if tiles:
            dw = tiles_matmul(x.reshape(m, k), dy.reshape(m, n), rhs_grad).reshape(w.shape).astype(rhs_dtype)
        return [dx if rows else by_recipe[0], dw if tiles else by_recipe[1]]

    return tuple(choose(kernels, lambda *a: list(recipe(*a)), lhs, rhs, g))


def _input_gradient(dy: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array:
    """``dy (m, n) . wᵀ``: ``dy``'s whole rows quantized in the row kernel (the recipe's values), or,
    where a row is too wide for a block (``n``: a vocabulary), in tiles along ``n``."""
    (m, n), k = dy.shape, w.shape[0]
    q_w, s_w = quantized_along(w, (1,))  # w's rows over N: what dx contracts
    if rows_blocks(m, n, k, np.dtype(dy.dtype).itemsize):  # w's rows read as stored: no transposed copy
        return rows_matmul(dy, q_w, s_w.reshape(1, k), out_dtype, weight_rows=True)
    return row_tiles_matmul(dy, q_w, s_w.T, out_dtype)


def _on_one_tpu(kernel: Callable, fallback: Callable, *args: jax.Array) -> list:
    """``fallback(*args)``, or ``kernel(*args)`` in a program lowered for one TPU (both: lists of arrays)."""
    on_tpu = lambda *a: on_one_device(kernel, fallback, *a, folds=False)  # noqa: E731
    return jax.lax.platform_dependent(*args, tpu=on_tpu, default=fallback)


#: How the kernel or the recipe is chosen (a name tests replace, to run the kernels interpreted on a CPU).
choose = _on_one_tpu
