"""Where an int8 matmul runs the fused Pallas kernels: a program lowered for one TPU.

:func:`forward` and :func:`backward` hold the XLA recipe (:mod:`.int8_matmul`) and
the kernels (:mod:`.int8_pallas`) side by side in a ``jax.lax.platform_dependent``:
a program lowered for a TPU runs the kernels, every other platform the recipe,
which stays exactly what it was (a CPU run, ``explain`` and the doctor see no
change). The kernel branch is chosen only when the program is lowered for one
device (as the Pallas flash attention is: :mod:`precision.autocast.tpu_flash`): a
Mosaic call is one custom call that XLA cannot split over devices, so a sharded
program keeps the recipe. Under ``vmap`` the recipe runs too.

The kernels take a product that is a matmul once its operands are viewed as
matrices, without a copy (:func:`kernel_sizes`): no batch axes, the activation's
trailing axes contracted with the weight's leading ones (``x . w``: a ``Dense``; a
``DenseGeneral`` over several axes, as the output projection of Flax's
``MultiHeadDotProductAttention`` contracts heads and head features) or with its
trailing ones (``x . wᵀ``: ``einsum("btd,vd->btv")``, a tied embedding read as a
head), in sizes their blocks take (:func:`.int8_pallas.rows_blocks` and its
siblings); anything else (a convolution, attention's batched products, a small or
odd shape) keeps the recipe, and so does each backward product no kernel takes. The forward product
and the input's gradient are the recipe's values bit for bit; the weight's
gradient is tiled along the tokens (:func:`.int8_pallas.tiles_matmul`), and a
head's input gradient along its vocabulary (:func:`.int8_pallas.row_tiles_matmul`):
close, not the same. With stochastic rounding the backward keeps the recipe (its
noise is drawn by XLA), and while the doctor records, both passes do (it reads
the recipe's scales).

An attention's operands are read and written heads-first (:class:`Heads`): a
product to ``(heads, head size)`` writes its result so, one contracting them
reads its input so, and their backward reads and writes the gradients the same
way: the layouts the attention kernel reads and writes, where the kernels' rows
would take XLA's copies.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from precision.autocast.scaled.int8_pallas import (as_matrix, heads_blocks, prologue_rows, row_tiles_blocks,
                                                  row_tiles_matmul, rows_blocks, rows_matmul, tiles_blocks,
                                                  tiles_matmul)
from precision.autocast.scaled.int8_quantize import quantized_along
from precision.autocast.tpu_flash import on_one_device

__all__ = ["Matmul", "Heads", "kernel_sizes", "heads_of", "forward", "backward", "choose"]


class Matmul(NamedTuple):
    """A ``dot_general`` viewed as the matmul ``(m, k) x (k, n)``; ``weight_rows``: the weight is held as
    ``(n, k)`` (its trailing axes contracted: ``x . wᵀ``)."""

    m: int
    k: int
    n: int
    weight_rows: bool = False


def kernel_sizes(lhs: Any, rhs: Any, dims: Any) -> Matmul | None:
    """``dot_general(lhs, rhs, dims)`` as a matmul the kernels may take, or None: no batch axes, the
    lhs's trailing axes contracted, in order, with the rhs's leading axes or its trailing ones (both
    operands then reshape to matrices without moving a value), the weight at least 2-D."""
    (lhs_contract, rhs_contract), (lhs_batch, _) = dims
    c = len(lhs_contract)
    if lhs_batch or not c or tuple(lhs_contract) != tuple(range(lhs.ndim - c, lhs.ndim)) or rhs.ndim <= c:
        return None
    m, k = math.prod(lhs.shape[:-c]), math.prod(lhs.shape[-c:])
    if tuple(rhs_contract) == tuple(range(c)):
        return Matmul(m, k, math.prod(rhs.shape[c:]))
    if tuple(rhs_contract) == tuple(range(rhs.ndim - c, rhs.ndim)):
        return Matmul(m, k, math.prod(rhs.shape[:-c]), weight_rows=True)
    return None


class Heads(NamedTuple):
    """Which operands of a matmul the kernels read or write heads-first, ``(sequences, heads, length,
    head size)``, as the attention kernel writes and reads them: the input where its contracted axes
    are ``(heads, head size)`` (an attention's output into its projection: ``x_heads`` of them), the
    result where the weight's free axes are (a query, key or value: ``out_heads``); 0: as rows."""

    length: int = 0
    x_heads: int = 0
    out_heads: int = 0

    def to_heads(self, a: jax.Array) -> jax.Array:
        """``(batch, length, heads, head size)`` viewed heads-first (a transpose XLA folds into the
        attention's own), or back: the transpose is its own inverse."""
        return a.transpose(0, 2, 1, 3)


def heads_of(lhs: Any, rhs: Any, dims: Any, sizes: Matmul) -> Heads:
    """The :class:`Heads` of a matmul the row kernel takes, where its blocks take them (forward and the
    input's gradient; the weight's gradient checks its own blocks)."""
    m, k, n, weight_rows = sizes
    c, itemsize = len(dims[0][0]), np.dtype(lhs.dtype).itemsize
    out = (*lhs.shape[:-c], *(rhs.shape[:-c] if weight_rows else rhs.shape[c:]))
    length = lhs.shape[1] if lhs.ndim >= 2 else 0
    out_heads = out[2] if lhs.ndim - c == 2 and len(out) == 4 and heads_blocks(m, k, n, length, out[2], itemsize) else 0
    x_heads = (lhs.shape[2] if lhs.ndim == 4 and c == 2 and not weight_rows and length % 128 == 0
               and heads_blocks(m, n, k, length, lhs.shape[2], itemsize) else 0)
    return Heads(length, x_heads, out_heads) if x_heads or out_heads else Heads()


def applied(activation: Any, params: tuple = ()) -> Callable[[jax.Array], jax.Array]:
    """``x ↦ activation(x, *params)`` in float32 (:class:`.int8_activation.Activation`, :class:`.int8_norm.RowNorm`),
    or ``x`` itself without one."""
    if activation is None:
        return lambda x: x
    return lambda x: activation(x.astype(np.float32), *[p.astype(np.float32) for p in params])


def forward(recipe: Callable, lhs: jax.Array, rhs: jax.Array, dims: Any, out_dtype: Any, use_kernel: bool,
            bias: jax.Array | None = None, activation: Any = None, params: tuple = ()) -> jax.Array:
    """``recipe(lhs, rhs)`` (the XLA recipe's product), or on one TPU (where ``use_kernel``: not while the
    doctor records, nor with ``precision.int8.tpu_kernels`` off) the row kernel computing the same.
    ``bias`` (``(1, ..., 1, n)``): added to the product, by the recipe as the model's ``add`` does (in
    ``out_dtype``), by the kernel in float32 before its result is rounded. ``activation``: applied to
    ``lhs`` first (with its ``params``), in float32 (by the row kernel to its blocks, where it reads rows)."""
    with_bias = (lambda y, b: y + b.astype(y.dtype)) if bias is not None else (lambda y, b: y)  # noqa: E731
    sizes = kernel_sizes(lhs, rhs, dims) if use_kernel else None
    itemsize = prologue_rows(np.dtype(lhs.dtype).itemsize, activation)
    if sizes is None or not rows_blocks(sizes.m, sizes.k, sizes.n, itemsize):
        return with_bias(recipe(applied(activation, params)(lhs), rhs), bias)
    m, k, n, weight_rows = sizes
    c = len(dims[0][0])  # the axes contracted
    out_shape = (*lhs.shape[:-c], *(rhs.shape[:-c] if weight_rows else rhs.shape[c:]))
    heads = heads_of(lhs, rhs, dims, sizes)

    given = 0 if bias is None else 1

    def kernel(x, w, *rest):  # w as (k, n), or (n, k) read as stored; quantized over the k it contracts
        q_w, s_w = quantized_along(w.reshape((n, k) if weight_rows else (k, n)), (1,) if weight_rows else (0,))
        row = rest[0].reshape(1, n).astype(np.float32) if given else None
        x = heads.to_heads(applied(activation, rest[given:])(x)) if heads.x_heads else x.reshape(m, k)
        y = rows_matmul(x, q_w, s_w.reshape(1, n), out_dtype, weight_rows=weight_rows, bias=row,
                        heads_first=(heads.length, heads.out_heads) if heads.out_heads else None,
                        activation=None if heads.x_heads else activation, params=rest[given:])
        return [heads.to_heads(y) if heads.out_heads else y.reshape(out_shape)]

    def by_recipe(x, w, *rest):
        return [with_bias(recipe(applied(activation, rest[given:])(x), w), rest[0] if given else None)]

    return choose(kernel, by_recipe, lhs, rhs, *([] if bias is None else [bias]), *params)[0]


def backward(recipe: Callable, lhs: jax.Array, rhs: jax.Array, g: jax.Array, dims: Any, grad_dtypes: Any,
             use_kernels: bool, bias: Any = None, activation: Any = None, params: tuple = ()) -> tuple[jax.Array, ...]:
    """``recipe(lhs, rhs, g)`` (the recipe's gradients: the operands' in their dtypes, then the activation's
    params'), or on one TPU the kernels: the input's gradient by the row kernel (``g``'s rows and ``w``'s
    rows quantized), the weight's by the tiled one; either by the recipe where its kernel cannot take the
    shapes (XLA drops the recipe's other product). Operands to or from heads as the forward reads and
    writes them (:class:`Heads`). ``grad_dtypes``: ((operand dtypes), (dtypes the products are made in)).
    ``bias`` (the forward's, ``(1, ..., 1, n)``): its gradient, ``g`` summed over the rows in float32
    (shaped as ``bias``), by the tiled kernel where it runs (the blocks of ``g`` it reads).
    ``activation``: the forward's (with its ``params``), ``lhs``'s gradient through it, and its params'
    (``recipe`` applies it too). Gradients in order: ``lhs``, ``rhs``, the bias, the params."""
    sums = _bias_gradient(bias)
    sizes = kernel_sizes(lhs, rhs, dims) if use_kernels else None
    if sizes is None:
        return _ordered(recipe(lhs, rhs, g, *params), sums(g))
    m, k, n, weight_rows = sizes
    x_size, g_size = np.dtype(lhs.dtype).itemsize, np.dtype(g.dtype).itemsize
    rows = rows_blocks(m, n, k, g_size) or row_tiles_blocks(m, n, k)
    whole = activation is not None and activation.row_wise  # tiles must hold whole rows to apply it
    tiles = tiles_blocks(m, n, k, g_size, x_size) if weight_rows else tiles_blocks(m, k, n, x_size, g_size)
    if not rows and not tiles:
        return _ordered(recipe(lhs, rhs, g, *params), sums(g))
    (lhs_dtype, rhs_dtype), (lhs_grad, rhs_grad) = grad_dtypes
    heads = heads_of(lhs, rhs, dims, sizes) if rows_blocks(m, n, k, g_size) else Heads()
    tiles_heads = heads if tiles_blocks(m, k, n, x_size, g_size, *heads) else Heads()
    in_tiles = activation is not None and not tiles_heads.x_heads and (
        not whole or tiles_blocks(m, k, n, x_size, g_size, *tiles_heads, whole_rows=True) is not None)
    leading = lhs.ndim - len(dims[0][0])  # the result's axes before the weight's: the rows
    sums_in_kernel = (bool(tiles) and not weight_rows and bias is not None and bias.size == n
                      and math.prod(bias.shape[:leading]) == 1)

    def kernels(x, w, dy, *ps):
        by_recipe = None if rows and tiles else recipe(x, w, dy, *ps)
        as_rows = lambda a, h: heads.to_heads(a) if h else a.reshape(m, a.size // m)  # noqa: E731
        d_params = by_recipe[2:] if by_recipe is not None and not rows else ()
        if rows:
            w2 = w.reshape(n, k) if weight_rows else w.reshape(k, n)
            through = (activation, x.reshape(m, k), ps) if activation is not None and not heads.x_heads else None
            dx, d_params = _input_gradient(as_rows(dy, heads.out_heads), w2, lhs_grad, weight_rows, heads, through)
            dx = heads.to_heads(dx) if heads.x_heads else dx.reshape(x.shape)
            if activation is not None and heads.x_heads:  # else _input_gradient went through it
                dx, *d_params = activation.backward(x.astype(np.float32), dx.astype(np.float32))
            dx = dx.astype(lhs_dtype)
        if tiles and weight_rows:  # dyᵀ . x for a weight held as (n, k)
            dw = tiles_matmul(dy.reshape(m, n), applied(activation, ps)(x).astype(x.dtype).reshape(m, k), rhs_grad)
        elif tiles:  # xᵀ . dy, and dy's column sums where they are the bias's gradient
            x_in = x if in_tiles or activation is None else applied(activation, ps)(x).astype(x.dtype)  # in its dtype
            x_in = as_rows(x_in, tiles_heads.x_heads)
            dw = tiles_matmul(x_in, as_rows(dy, tiles_heads.out_heads), rhs_grad, g_sums=sums_in_kernel,
                              activation=activation if in_tiles else None, params=ps if in_tiles else ())
        dw, d_bias = (dw[0], [dw[1].reshape(bias.shape)]) if sums_in_kernel else (dw, sums(dy))
        dw = dw.reshape(w.shape).astype(rhs_dtype) if tiles else by_recipe[1]
        d_params = [d.reshape(p.shape).astype(p.dtype) for d, p in zip(d_params, ps)]
        return [dx if rows else by_recipe[0], dw, *d_bias, *d_params]

    return tuple(choose(kernels, lambda x, w, dy, *ps: _ordered(recipe(x, w, dy, *ps), sums(dy)), lhs, rhs, g,
                        *params))


def _ordered(made: Any, d_bias: list) -> list:
    """The recipe's gradients (``lhs``, ``rhs``, the params') with the bias's in their place, after ``rhs``'s."""
    made = list(made)
    return [*made[:2], *d_bias, *made[2:]]


def _bias_gradient(bias: Any) -> Callable[[jax.Array], list]:
    """``[dy summed in float32 over the axes bias is broadcast along]`` (shaped as ``bias``), or ``[]``
    without a bias: the recipe's bias gradient, where no kernel makes it."""
    if bias is None:
        return lambda dy: []
    axes = tuple(i for i, size in enumerate(bias.shape) if size == 1)
    return lambda dy: [dy.astype(np.float32).sum(axis=axes, keepdims=True).reshape(bias.shape)]


def _input_gradient(dy: jax.Array, w: jax.Array, out_dtype: Any, weight_rows: bool = False, heads: Heads = Heads(),
                    through: tuple | None = None) -> tuple[jax.Array, tuple]:
    """``(the input's gradient, the activation's params' gradients)`` from ``dy (m, n)``: ``dy . wᵀ`` for a
    weight ``w (k, n)``, ``dy . w`` for one held as ``w (n, k)`` (``weight_rows``); ``dy``'s whole rows
    quantized in the row kernel (the recipe's values), or, where a row is too wide for a block (``n``: a
    vocabulary), in tiles along ``n``. ``heads``: ``dy`` given heads-first (``out_heads``), the result
    written so (``x_heads``). ``through``: ``(activation, h, params)``, the result taken through the
    activation's derivative at ``h`` (``(m, k)``): ``h``'s gradient, and its params' (by the row kernel
    before its rounding, a norm's where its block holds whole rows; else by XLA, after it)."""
    m, n = as_matrix(dy.shape)
    k = w.shape[1] if weight_rows else w.shape[0]
    q_w, s_w = quantized_along(w, (0,) if weight_rows else (1,))  # quantized over the n it contracts
    s_w = s_w.reshape(1, k)
    blocks = rows_blocks(m, n, k, np.dtype(dy.dtype).itemsize)
    by_xla = through is not None and (blocks is None or (through[0].row_wise and blocks[1] != k))
    if blocks:  # w read as stored: no transposed copy
        d = rows_matmul(dy, q_w, s_w, out_dtype, weight_rows=not weight_rows,
                        heads_first=(heads.length, heads.x_heads) if heads.x_heads else None,
                        **({} if through is None or by_xla else
                           {"activation": through[0], "activation_of": through[1], "params": through[2]}))
    else:
        d = row_tiles_matmul(dy, q_w.T if weight_rows else q_w, s_w, out_dtype)
    if through is None:
        return d, ()
    if by_xla:
        d, *d_params = through[0].backward(through[1].astype(np.float32), d.astype(np.float32),
                                           *[p.reshape(1, p.size).astype(np.float32) for p in through[2]])
        return d.astype(out_dtype), tuple(d_params)
    if through[2]:  # the params' partial sums, one per row block
        d, partial = d
        return d, tuple(p.sum(axis=(0, 1)) for p in partial)
    return d, ()


def _on_one_tpu(kernel: Callable, fallback: Callable, *args: jax.Array) -> list:
    """``fallback(*args)``, or ``kernel(*args)`` in a program lowered for one TPU (both: lists of arrays)."""
    on_tpu = lambda *a: on_one_device(kernel, fallback, *a, folds=False)  # noqa: E731
    return jax.lax.platform_dependent(*args, tpu=on_tpu, default=fallback)


#: How the kernel or the recipe is chosen (a name tests replace, to run the kernels interpreted on a CPU).
choose = _on_one_tpu
