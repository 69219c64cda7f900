"""An int8 matmul: ``dot_general`` on int8 operands into int32, scaled per row and column,
with a backward of its own.

The product of AQT, SwitchBack and torchao's row-wise int8 training: each
operand quantized along the axes the product contracts (a row of the
activation, a column of the weight; :mod:`.int8_quantize`), multiplied by the
matrix unit into int32 (exact: 127² x K stays far inside int32 for any K
below 133,000), and dequantized with the outer product of the two operands'
scales into the output dtype::

    q_x, s_x = int8(x / (absmax_row(x) / 127)), q_w, s_w = int8(w / (absmax_col(w) / 127))
    y = float(dot_general(q_x, q_w, preferred_element_type=int32)) * s_x * s_w

Backward, each product contracts other axes, so each operand is quantized again
along the axes its product contracts, from the operands saved as they came (16
or 32 bits). The output gradient ``g`` is quantized once, per row (over N), and
serves both products: ``dx`` = ``q_g`` x ``w`` per row (over N), scaled by both;
for ``dw`` = ``xᵀ g``, which contracts the rows (M), ``g``'s row scales are moved
onto ``x`` (``x'[m, k] = x[m, k] s_g[m]``, exact algebra), which is then quantized
per column (over M): one pass over ``g`` and one int8 copy of it instead of two
(the largest tensor of a language model's head). ``backward="bf16"`` makes both
products in the fallback dtype instead. The output gradient may round
stochastically (:func:`.int8_quantize.stochastic_noise`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from precision.autocast.scaled import int8_tpu
from precision.autocast.scaled.int8_quantize import F32, INT32, quantized_along, record, stochastic_noise
from precision.autocast.scaled.products import (Product, in_output_layout, operand_dtypes, remaining,
                                                 transpose_lhs, transpose_rhs)

__all__ = ["Backward", "int8_dot", "int8_product", "fallback_product"]


class Backward(NamedTuple):
    """How an int8 product's backward runs (static): both products in int8 (else in
    ``fallback``), the output gradient rounded stochastically (``salt``: which matmul);
    ``where``: its module, when the doctor records (:func:`.int8_quantize.record`);
    ``kernels``: a TPU's kernels may run; ``narrow_gradient``: the output gradient is read in
    ``fallback`` (a float32 result written for the program's output: its gradient as a 16-bit one's)."""

    int8: bool = True
    stochastic: bool = False
    fallback: np.dtype = np.dtype(np.float32)
    salt: int = 0
    where: str = ""
    kernels: bool = True
    narrow_gradient: bool = False  # the output gradient read in ``fallback`` (a result widened for the program)


def int8_product(out_dtype: Any, noise_salt: int | None = None, where: str = "", pass_: str = "forward"
                 ) -> Product:
    """A ``dot_general(a, b, dims)`` of two operands each quantized to int8 along its own
    contracted axes, accumulated in int32 and dequantized into ``out_dtype``; the first
    operand rounded stochastically when ``noise_salt`` is given (the gradient's). ``where``,
    ``pass_``: what the doctor's recording calls it (:func:`.int8_quantize.record`)."""

    def product(a: jax.Array, b: jax.Array, dims: Any) -> jax.Array:
        (a_contract, b_contract), (a_batch, b_batch) = dims
        noise = None if noise_salt is None else stochastic_noise(a, noise_salt)
        q_a, s_a = quantized_along(a, a_contract, noise)
        q_b, s_b = quantized_along(b, b_contract)
        names = ("input", "weight") if pass_ == "forward" else ("gradient", "operand")
        record(where, pass_, names[0], a, s_a)
        record(where, pass_, names[1], b, s_b)
        acc = lax.dot_general(q_a, q_b, dims, preferred_element_type=INT32)
        a_free = a.ndim - len(a_contract) - len(a_batch)
        b_free = b.ndim - len(b_contract) - len(b_batch)
        scales = (in_output_layout(s_a, a_contract, a_batch, 0, b_free)
                  * in_output_layout(s_b, b_contract, b_batch, a_free, 0))
        return (acc.astype(F32) * scales).astype(out_dtype)

    return product


def _given_first(scale_a: jax.Array | None, out_dtype: Any, where: str) -> Product:
    """A ``dot_general`` whose first operand arrives in int8 (its scales ``scale_a``, None: already
    moved onto the second), the second quantized along its contracted axes; into ``out_dtype``."""

    def product(q_a: jax.Array, b: jax.Array, dims: Any) -> jax.Array:
        (a_contract, b_contract), (a_batch, b_batch) = dims
        q_b, s_b = quantized_along(b, b_contract)
        record(where, "backward", "operand", b, s_b)
        acc = lax.dot_general(q_a, q_b, dims, preferred_element_type=INT32)
        a_free = q_a.ndim - len(a_contract) - len(a_batch)
        b_free = b.ndim - len(b_contract) - len(b_batch)
        scales = in_output_layout(s_b, b_contract, b_batch, a_free, 0)
        if scale_a is not None:
            scales = scales * in_output_layout(scale_a, a_contract, a_batch, 0, b_free)
        return (acc.astype(F32) * scales).astype(out_dtype)

    return product


def _row_scales_on_lhs(s_g: jax.Array, lhs: jax.Array, dims: Any) -> jax.Array:
    """``g``'s scales (its shape, its rhs-free axes of size 1) laid out on ``lhs``'s axes (its
    batch and free axes; its contracted ones of size 1), to multiply ``lhs`` by."""
    (lhs_contract, _), (lhs_batch, _) = dims
    free = remaining(lhs.ndim, lhs_contract, lhs_batch)
    kept = s_g.reshape(s_g.shape[:len(lhs_batch) + len(free)] + (1,) * len(lhs_contract))
    order = [*lhs_batch, *free, *lhs_contract]  # kept's axis j is lhs's axis order[j]
    return lax.transpose(kept, tuple(int(i) for i in np.argsort(order)))


def fallback_product(compute: Any, out_dtype: Any) -> Product:
    """A ``dot_general`` with both operands in ``compute`` (the policy's fallback dtype), its result in
    ``compute`` too (as the fallback policy's own matmul gives it; XLA:CPU has no bf16 x bf16 -> f32
    dot), then cast to ``out_dtype``."""
    return lambda a, b, dims: lax.dot_general(a.astype(compute), b.astype(compute), dims,
                                              preferred_element_type=compute).astype(out_dtype)


def _as_dims(dims: Any) -> tuple:
    (lc, rc), (lb, rb) = dims
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _int8_dot(lhs, rhs, bias, params, dims, out_dtype, in_dtypes, backward, activation):
    recipe = functools.partial(int8_product(out_dtype, where=backward.where), dims=dims)
    return int8_tpu.forward(recipe, lhs, rhs, dims, out_dtype, backward.kernels and not backward.where, bias,
                            activation, params)


def _int8_dot_fwd(lhs, rhs, bias, params, dims, out_dtype, in_dtypes, backward, activation):
    made = _int8_dot(lhs, rhs, bias, params, dims, out_dtype, in_dtypes, backward, activation)
    return made, (lhs, rhs, bias, params)


def _int8_dot_bwd(dims, out_dtype, in_dtypes, backward, activation, residuals, g):
    lhs, rhs, bias, params = residuals
    g = g.astype(backward.fallback) if backward.narrow_gradient else g
    recipe = functools.partial(_recipe_bwd, dims, in_dtypes, backward, activation)
    use_kernels = backward.kernels and backward.int8 and not backward.stochastic and not backward.where
    d_lhs, d_rhs, *rest = int8_tpu.backward(recipe, lhs, rhs, g, dims, in_dtypes, use_kernels, bias, activation,
                                            params)
    d_bias = None if bias is None else rest.pop(0).astype(bias.dtype)
    return d_lhs, d_rhs, d_bias, tuple(d.astype(p.dtype) for d, p in zip(rest, params))


def _recipe_bwd(dims, in_dtypes, backward, activation, lhs, rhs, g, *params):
    """The two gradients by the XLA recipe (see the module's docstring); ``lhs``'s through ``activation``
    (applied to it in float32 by the forward, with its ``params``), where there is one, then its params'."""
    if activation is not None:
        h, ps = lhs.astype(F32), [p.astype(F32) for p in params]
        d_act, d_rhs = _recipe_bwd(dims, in_dtypes, backward, None, activation(h, *ps), rhs, g)
        d_lhs, *d_params = activation.backward(h, d_act.astype(F32), *ps)
        return (d_lhs.astype(lhs.dtype), d_rhs, *(d.astype(p.dtype) for d, p in zip(d_params, params)))
    (lhs_dtype, rhs_dtype), (lhs_grad, rhs_grad) = in_dtypes
    if not backward.int8:
        d_lhs = transpose_lhs(g, rhs, dims, lhs.ndim, product=fallback_product(backward.fallback, lhs_grad))
        d_rhs = transpose_rhs(g, lhs, dims, rhs.ndim, product=fallback_product(backward.fallback, rhs_grad))
        return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)
    (_, rhs_contract), (lhs_batch, rhs_batch) = dims
    n_lhs_free = lhs.ndim - len(dims[0][0]) - len(lhs_batch)
    rows = tuple(range(len(lhs_batch) + n_lhs_free, g.ndim))  # g's rhs-free axes: what dx contracts
    noise = stochastic_noise(g, 2 * backward.salt) if backward.stochastic else None
    q_g, s_g = quantized_along(g, rows, noise)
    record(backward.where, "backward", "gradient", g, s_g)
    d_lhs = transpose_lhs(q_g, rhs, dims, lhs.ndim, product=_given_first(s_g, lhs_grad, backward.where))
    moved = lhs.astype(F32) * _row_scales_on_lhs(s_g, lhs, dims)  # quantized from float32: no 16-bit pass
    d_rhs = transpose_rhs(q_g, moved, dims, rhs.ndim, product=_given_first(None, rhs_grad, backward.where))
    return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)


_int8_dot.defvjp(_int8_dot_fwd, _int8_dot_bwd)


def int8_dot(lhs: jax.Array, rhs: jax.Array, dims: Any, out_dtype: Any, backward: Backward = Backward(),
             grad_dtypes: tuple[Any, Any] | None = None, bias: jax.Array | None = None, activation: Any = None,
             params: tuple = ()) -> jax.Array:
    """``dot_general(lhs, rhs, dims)`` with int8 operands and int32 accumulation, the result
    in ``out_dtype``: each operand scaled along the axes it contracts (a row of the
    activation, a column of the weight). Backward as ``backward`` says (both products in
    int8 by default). ``grad_dtypes``: the dtypes the two gradients' products are made in
    (default: the operands'), each then cast to its operand's dtype (a param's gradient
    made in ``reduce_dtype`` is what a data-parallel step reduces across devices).
    ``bias``: shaped as the result but 1 along every axis it is broadcast over, added to it (in
    ``out_dtype``, as the model's ``add``; on a TPU inside the kernel, in float32). ``activation``
    (:class:`.int8_activation.Activation`): the product is of ``activation(lhs)``, computed in float32 (on a
    TPU by the kernels, on their blocks), and ``lhs``'s gradient is through it; a norm
    (:class:`.int8_norm.RowNorm`) reads its ``params`` too (its scale and offset), and gives them gradients."""
    args = (_as_dims(dims), np.dtype(out_dtype), operand_dtypes(lhs, rhs, grad_dtypes), backward, activation)
    return _int8_dot(lhs, rhs, bias, tuple(params), *args)
