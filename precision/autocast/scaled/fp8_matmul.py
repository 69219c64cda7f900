"""An FP8 matmul: ``dot_general`` on float8 operands, scaled, its backward in FP8 too.

The standard hybrid recipe (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"; Transformer Engine; torchao): forward operands (activations and
weights) in E4M3 (more precision), the gradient in E5M2 (more range), products
accumulated in float32 by the matmul unit (:mod:`.fp8_quantize` for the
scales). Two recipes:

- **tensorwise** (:func:`scaled_dot`): one scale per tensor, from its own amax
  (current scaling) or from an amax history (delayed). What the program holds,
  and what XLA's GPU compiler turns into cuBLASLt FP8 GEMMs with the scales
  folded in (as ``flax.linen.fp8_ops`` does with direct quantization)::

      q_x = f8(clip(x * s_x)), q_w = f8(clip(w * s_w))
      y   = dot_general(q_x, q_w) / (s_x * s_w)

  and, backward, ``dx`` and ``dw`` as the transposed ``dot_general`` of the
  E5M2 gradient with the saved E4M3 operand (saved in one byte per element).
- **rowwise** (:func:`rowwise_dot`, torchao's recipe of that name): a scale per
  slice along the contracted axes (a row of the activation, a column of the
  weight), so one outlier costs precision only to its own row. The float32
  product is divided by the outer product of the two operands' scales. Every
  product contracts other axes, so the backward quantizes again along its own
  contracted axes, from the operands saved as they came (16 or 32 bits).

**Accumulation.** On CUDA each FP8 product names its dot algorithm: the
forward ``ANY_F8_ANY_F8_F32_FAST_ACCUM`` (cuBLASLt's fast, reduced-precision
accumulation: safe for the forward pass, XLA says), the backward
``ANY_F8_ANY_F8_F32`` (full float32 accumulation: gradients add up many small
contributions). A named algorithm also keeps the product a cuBLASLt FP8 GEMM:
XLA's Triton GEMMs cannot take one, and accumulate f8 dots imprecisely whatever
the precision asked. Elsewhere (XLA:CPU refuses these algorithms) the forward
runs at the default precision and the backward at ``Precision.HIGHEST``; XLA:CPU
accumulates in float32 either way. (``jax.lax.platform_dependent`` holds both:
the program lowered for CUDA keeps the first.)

A non-finite operand makes the products it enters NaN (a saturating cast would
hide an inf), so a non-finite step stays non-finite and the loss-scale
machinery skips it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax import lax

from precision.autocast.scaled.products import (Product, in_output_layout, matmul_sizes, operand_dtypes,
                                                 transpose_lhs, transpose_rhs)
from precision.autocast.scaled.fp8_quantize import (E4M3, E5M2, F32, Histories, amax, e4m3_read, quantized,
                                                    quantized_along, roll_history, scale_for)

__all__ = ["E4M3", "E5M2", "Histories", "amax", "scale_for", "scaled_dot", "rowwise_dot", "roll_history",
           "matmul_sizes", "transpose_lhs", "transpose_rhs", "f8_dot", "FORWARD_PRECISION",
           "BACKWARD_PRECISION"]

#: (on CUDA, elsewhere) how a forward product accumulates: fast (reduced precision) on Hopper.
FORWARD_PRECISION = (lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM, lax.Precision.DEFAULT)
#: (on CUDA, elsewhere) how a backward product accumulates: in full float32.
BACKWARD_PRECISION = (lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32, lax.Precision.HIGHEST)



def f8_dot(a: jax.Array, b: jax.Array, dims: Any, out_dtype: Any, precision: tuple) -> jax.Array:
    """``dot_general`` of two FP8 operands into ``out_dtype``, at ``precision``
    (:data:`FORWARD_PRECISION` or :data:`BACKWARD_PRECISION`): its CUDA algorithm
    where the program is lowered for CUDA, its precision elsewhere."""
    on_cuda, elsewhere = precision
    return lax.platform_dependent(
        a, b, cuda=lambda a, b: lax.dot_general(a, b, dims, precision=on_cuda, preferred_element_type=out_dtype),
        default=lambda a, b: lax.dot_general(a, b, dims, precision=elsewhere, preferred_element_type=out_dtype))


# ----------------------------------------------------------------------------- dequantizing


def _as_dims(dims: Any) -> tuple:
    (lc, rc), (lb, rb) = dims
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def _accumulator(dtype: np.dtype) -> np.dtype:
    """The dtype a product of scaled FP8 values leaves the matmul unit in: ``dtype``,
    except float16, whose range a product of scaled values (448 x 57344 per term) exceeds."""
    return F32 if np.dtype(dtype) == np.dtype(np.float16) else np.dtype(dtype)


def _unscaled(product: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    """``product / scale`` in ``dtype`` (an exact division: the scale is a power of two)."""
    return (product * (1.0 / scale).astype(product.dtype)).astype(dtype)


def _axiswise_product(formats: tuple[np.dtype, np.dtype], out_dtype: np.dtype, precision: Any) -> Product:
    """A ``dot_general`` of two operands each quantized along its own contracted axes
    (``formats``: lhs's and rhs's FP8 format), dequantized after the GEMM (its output in
    ``out_dtype``: dividing by a power of two per row and column adds no rounding)."""

    def product(a: jax.Array, b: jax.Array, dims: Any) -> jax.Array:
        (a_contract, b_contract), (a_batch, b_batch) = dims
        q_a, s_a = quantized_along(a, a_contract, formats[0])
        q_b, s_b = quantized_along(b, b_contract, formats[1])
        acc = f8_dot(q_a, q_b, dims, _accumulator(out_dtype), precision)  # 16-bit out: the scales are exact
        a_free = a.ndim - len(a_contract) - len(a_batch)
        b_free = b.ndim - len(b_contract) - len(b_batch)
        scales = (in_output_layout(s_a, a_contract, a_batch, 0, b_free)
                  * in_output_layout(s_b, b_contract, b_batch, a_free, 0))
        return _unscaled(acc, scales, out_dtype)

    return product


# ----------------------------------------------------------------------------- tensorwise


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _scaled_dot(lhs, rhs, histories, dims, out_dtype, in_dtypes):
    return _forward(lhs, rhs, histories, dims, out_dtype, in_dtypes)[0]
# in_dtypes: ((lhs dtype, rhs dtype), (the dtypes their gradients are produced in)).


def _operand(x: jax.Array, history: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An operand in E4M3 (its scale, its amax); current scaling through :func:`e4m3_read`,
    the named sub-program where FSDP sees a param it may gather in FP8 (:mod:`precision.reads`)."""
    return e4m3_read(x) if history is None else quantized(x, history, E4M3)


def _forward(lhs, rhs, histories, dims, out_dtype, in_dtypes):
    q_lhs, s_lhs, a_lhs = _operand(lhs, histories.lhs if histories else None)
    q_rhs, s_rhs, a_rhs = _operand(rhs, histories.rhs if histories else None)
    product = f8_dot(q_lhs, q_rhs, dims, _accumulator(out_dtype), FORWARD_PRECISION)
    out = _unscaled(product, s_lhs * s_rhs, out_dtype)
    return out, (q_lhs, q_rhs, s_lhs, s_rhs, a_lhs, a_rhs, histories)


def _backward_product(out_dtype: np.dtype) -> Product:
    return lambda a, b, dims: f8_dot(a, b, dims, _accumulator(out_dtype), BACKWARD_PRECISION)


def _backward(dims, out_dtype, in_dtypes, residuals, g):
    q_lhs, q_rhs, s_lhs, s_rhs, a_lhs, a_rhs, histories = residuals
    (lhs_dtype, rhs_dtype), (lhs_grad, rhs_grad) = in_dtypes
    q_g, s_g, a_g = quantized(g, histories.grad if histories else None, E5M2)
    d_lhs = _unscaled(transpose_lhs(q_g, q_rhs, dims, q_lhs.ndim, product=_backward_product(lhs_grad)),
                      s_g * s_rhs, lhs_grad).astype(lhs_dtype)
    d_rhs = _unscaled(transpose_rhs(q_g, q_lhs, dims, q_rhs.ndim, product=_backward_product(rhs_grad)),
                      s_g * s_lhs, rhs_grad).astype(rhs_dtype)
    new = ()
    if histories:  # their "gradient" is the new history (see precision.fp8: the state's update)
        new = Histories(roll_history(histories.lhs, a_lhs), roll_history(histories.rhs, a_rhs),
                        roll_history(histories.grad, a_g))
    return d_lhs, d_rhs, new


def _scaled_dot_fwd(lhs, rhs, histories, dims, out_dtype, in_dtypes):
    return _forward(lhs, rhs, histories, dims, out_dtype, in_dtypes)


_scaled_dot.defvjp(_scaled_dot_fwd, _backward)


def scaled_dot(lhs: jax.Array, rhs: jax.Array, dims: Any, out_dtype: Any,
               histories: Histories | None = None, grad_dtypes: tuple[Any, Any] | None = None) -> jax.Array:
    """``dot_general(lhs, rhs, dims)`` in FP8, the result in ``out_dtype``.

    Operands are quantized to E4M3 and the output gradient to E5M2, each with
    its own power-of-two scale: from its own amax (``histories=None``, current
    scaling) or from the largest amax of its history (delayed scaling). Under
    differentiation with respect to ``histories``, their cotangent is the new
    histories (this step's amaxes recorded): the train step stores it.
    ``grad_dtypes``: the dtypes the two gradients' products are made in (default: the
    operands'), each then cast to its operand's dtype: a param's gradient made in
    ``reduce_dtype`` is what a data-parallel step reduces across devices.
    """
    return _scaled_dot(lhs, rhs, histories if histories is not None else (), _as_dims(dims), np.dtype(out_dtype),
                       operand_dtypes(lhs, rhs, grad_dtypes))


# ----------------------------------------------------------------------------- rowwise


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rowwise(lhs, rhs, dims, out_dtype, in_dtypes):
    return _axiswise_product((E4M3, E4M3), out_dtype, FORWARD_PRECISION)(lhs, rhs, dims)


def _rowwise_fwd(lhs, rhs, dims, out_dtype, in_dtypes):
    return _rowwise(lhs, rhs, dims, out_dtype, in_dtypes), (lhs, rhs)


def _rowwise_bwd(dims, out_dtype, in_dtypes, residuals, g):
    lhs, rhs = residuals
    (lhs_dtype, rhs_dtype), (lhs_grad, rhs_grad) = in_dtypes
    d_lhs = transpose_lhs(g, rhs, dims, lhs.ndim, product=_axiswise_product((E5M2, E4M3), lhs_grad,
                                                                              BACKWARD_PRECISION))
    d_rhs = transpose_rhs(g, lhs, dims, rhs.ndim, product=_axiswise_product((E5M2, E4M3), rhs_grad,
                                                                             BACKWARD_PRECISION))
    return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)


_rowwise.defvjp(_rowwise_fwd, _rowwise_bwd)


def rowwise_dot(lhs: jax.Array, rhs: jax.Array, dims: Any, out_dtype: Any,
                grad_dtypes: tuple[Any, Any] | None = None) -> jax.Array:
    """``dot_general(lhs, rhs, dims)`` in FP8 with a scale per row: each operand scaled
    along the axes it contracts (a row of the activation, a column of the weight),
    the float32 product divided by the outer product of the scales. Backward, the
    E5M2 gradient and the E4M3 operand are quantized again along the axes each
    transposed product contracts. ``grad_dtypes``: as :func:`scaled_dot`'s."""
    return _rowwise(lhs, rhs, _as_dims(dims), np.dtype(out_dtype), operand_dtypes(lhs, rhs, grad_dtypes))
