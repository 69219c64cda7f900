"""An int8 convolution: int8 operands into int32, a scale per example and per output
channel, with a backward in int8 of its own.

A convolution contracts each output pixel over its window and input channels, so
a scale constant over those axes is one per example of the input and one per
output channel of the kernel (AQT's per-channel recipe)::

    y[n, ..., o] = float(conv(q_x, q_w) -> int32)[n, ..., o] * s_x[n] * s_w[o]

Its two backward products are convolutions too (JAX's transposes of this one):
the input's gradient contracts the output gradient's pixels and channels with
the kernel's window and output channels (scales: per example of the gradient,
per input channel of the kernel), the kernel's gradient contracts examples and
pixels (per input channel of the input, per output channel of the gradient).
They are taken from JAX's own transpose rules, traced once in float32 and
evaluated again on int8 operands with int32 results. Grouped convolutions stay
out (their transposes group examples).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import DropVar, Literal

from precision.autocast.scaled.int8_matmul import Backward
from precision.autocast.scaled.int8_quantize import F32, INT32, quantized_along, record, stochastic_noise
from precision.autocast.scaled.products import operand_dtypes

__all__ = ["int8_conv", "conv_int8_problem"]


def conv_int8_problem(params: dict) -> str | None:
    """Why a convolution with these params stays out of int8 (None: it may be int8)."""
    if params.get("feature_group_count", 1) != 1 or params.get("batch_group_count", 1) != 1:
        return "grouped convolution stays out of int8"
    return None


def _per(x: jax.Array, axis: int, noise: jax.Array | None = None, recorded: tuple = ()
         ) -> tuple[jax.Array, jax.Array]:
    """``x`` in int8 with one scale per index of ``axis`` (over every other axis); the scales flat.
    ``recorded``: (module, pass, operand) for the doctor's recording."""
    q, scale = quantized_along(x, [d for d in range(x.ndim) if d != axis], noise)
    if recorded:
        record(*recorded, x, scale)
    return q, scale.reshape(-1)


def _along(scale: jax.Array, axis: int, ndim: int) -> jax.Array:
    """Flat scales shaped to broadcast along ``axis`` of an ``ndim``-dimensional result."""
    shape = [1] * ndim
    shape[axis] = scale.shape[0]
    return scale.reshape(shape)


def _int_conv(params: dict) -> Callable:
    """The convolution with these params on int8 operands, into int32."""
    return lambda a, b: lax.conv_general_dilated_p.bind(a, b, **{**params, "preferred_element_type": INT32,
                                                                  "precision": None})


def _live(jaxpr: Any) -> list:
    """The equations the outputs need (the transpose's dead forward convolution dropped)."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars if not isinstance(v, DropVar)):
            live.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    return live[::-1]


def _on_ints(jaxpr: Any, args: list) -> jax.Array:
    """Evaluates a traced transpose (convolutions, reversals, pads) on int8 operands,
    each convolution into int32."""
    env = dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
    for eqn in _live(jaxpr):
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive is lax.conv_general_dilated_p:
            out = _int_conv(eqn.params)(*ins)
        else:
            if eqn.primitive is lax.pad_p:
                ins[1] = jnp.zeros((), ins[0].dtype)
            out = eqn.primitive.bind(*ins, **eqn.params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
    return read(jaxpr.outvars[0])


@functools.lru_cache(maxsize=256)
def _transpose(params: tuple, wrt: int, shapes: tuple) -> Any:
    """JAX's transpose of the convolution with respect to operand ``wrt`` (0: input,
    1: kernel), traced in float32 as a function of (the other operand, the gradient)."""
    x_shape, w_shape, y_shape = shapes
    conv = lambda x, w: lax.conv_general_dilated_p.bind(x, w, **dict(params))  # noqa: E731
    if wrt == 0:
        fn = lambda w, g: jax.vjp(lambda x: conv(x, w), jnp.zeros(x_shape, F32))[1](g)[0]  # noqa: E731
        other = w_shape
    else:
        fn = lambda x, g: jax.vjp(lambda w: conv(x, w), jnp.zeros(w_shape, F32))[1](g)[0]  # noqa: E731
        other = x_shape
    return jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(other, F32), jax.ShapeDtypeStruct(y_shape, F32))


def _frozen(params: dict) -> tuple:
    """The params as a static argument (hashable), asking for no result type of their own."""
    return tuple(sorted({**params, "preferred_element_type": None}.items()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _int8_conv(lhs, rhs, params, out_dtype, in_dtypes, backward):
    spec = dict(params)["dimension_numbers"]
    q_x, s_x = _per(lhs, spec.lhs_spec[0], recorded=(backward.where, "forward", "input"))
    q_w, s_w = _per(rhs, spec.rhs_spec[0], recorded=(backward.where, "forward", "weight"))
    acc = _int_conv(dict(params))(q_x, q_w)
    scales = _along(s_x, spec.out_spec[0], acc.ndim) * _along(s_w, spec.out_spec[1], acc.ndim)
    return (acc.astype(F32) * scales).astype(out_dtype)


def _int8_conv_fwd(lhs, rhs, params, out_dtype, in_dtypes, backward):
    return _int8_conv(lhs, rhs, params, out_dtype, in_dtypes, backward), (lhs, rhs)


def _int8_conv_bwd(params, out_dtype, in_dtypes, backward, residuals, g):
    lhs, rhs = residuals
    (lhs_dtype, rhs_dtype), (lhs_grad, rhs_grad) = in_dtypes
    if not backward.int8:
        conv = lambda x, w: lax.conv_general_dilated_p.bind(  # noqa: E731
            x.astype(backward.fallback), w.astype(backward.fallback), **dict(params))
        _, pullback = jax.vjp(conv, lhs, rhs)
        d_lhs, d_rhs = pullback(g.astype(backward.fallback))
        return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)
    spec = dict(params)["dimension_numbers"]
    shapes = (lhs.shape, rhs.shape, g.shape)
    noise = stochastic_noise(g, 2 * backward.salt) if backward.stochastic else None
    q_g, s_g = _per(g, spec.out_spec[0], noise, (backward.where, "backward", "gradient"))  # per example
    q_w, s_w = _per(rhs, spec.rhs_spec[1])  # per input channel
    closed = _transpose(params, 0, shapes)
    d_lhs = _on_ints(closed.jaxpr, [q_w, q_g]).astype(F32)
    d_lhs = d_lhs * _along(s_g, spec.lhs_spec[0], lhs.ndim) * _along(s_w, spec.lhs_spec[1], lhs.ndim)
    q_g, s_g = _per(g, spec.out_spec[1], noise)  # per output channel: the kernel's gradient contracts examples
    q_x, s_x = _per(lhs, spec.lhs_spec[1])  # per input channel
    closed = _transpose(params, 1, shapes)
    d_rhs = _on_ints(closed.jaxpr, [q_x, q_g]).astype(F32)
    d_rhs = d_rhs * _along(s_x, spec.rhs_spec[1], rhs.ndim) * _along(s_g, spec.rhs_spec[0], rhs.ndim)
    return d_lhs.astype(lhs_grad).astype(lhs_dtype), d_rhs.astype(rhs_grad).astype(rhs_dtype)


_int8_conv.defvjp(_int8_conv_fwd, _int8_conv_bwd)


def int8_conv(lhs: jax.Array, rhs: jax.Array, params: dict, out_dtype: Any, backward: Backward = Backward(),
              grad_dtypes: tuple[Any, Any] | None = None) -> jax.Array:
    """``conv_general_dilated(lhs, rhs, **params)`` with int8 operands and int32
    accumulation, the result in ``out_dtype``: the input scaled per example, the kernel
    per output channel; backward as ``backward`` says (in int8 by default).
    ``grad_dtypes``: as :func:`.int8_matmul.int8_dot`'s."""
    return _int8_conv(lhs, rhs, _frozen(params), np.dtype(out_dtype), operand_dtypes(lhs, rhs, grad_dtypes),
                      backward)
