"""An FP8 matmul: ``dot_general`` on float8 operands, per-tensor scaled, its
backward in FP8 too.

The standard hybrid recipe (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"; Transformer Engine; torchao): forward operands (activations and
weights) in E4M3 (more precision), the gradient in E5M2 (more range), products
accumulated in float32 by the matmul unit. Each tensor gets one scale, a power
of two chosen from its absolute maximum (*amax*) so the largest value lands
near the format's largest finite value: current scaling takes the amax of the
tensor itself, delayed scaling the largest of the amaxes of the last steps
(an *amax history*) and records this step's.

What the program holds, and what XLA's GPU compiler turns into cuBLASLt FP8
GEMMs with the scales folded in (as ``flax.linen.fp8_ops`` does with direct
quantization):

    q_x = f8(clip(x * s_x)), q_w = f8(clip(w * s_w))
    y   = dot_general(q_x, q_w) / (s_x * s_w)

and, backward, ``dx`` and ``dw`` as the transposed ``dot_general`` of the
E5M2 gradient with the saved E4M3 operand (saved in one byte per element).
A power-of-two scale adds no rounding of its own: the only error is FP8's.

A non-finite operand makes the whole product NaN (a saturating cast would
hide an inf), so a non-finite step stays non-finite and the loss-scale
machinery skips it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["E4M3", "E5M2", "Histories", "amax", "scale_for", "quantize", "scaled_dot", "roll_history",
           "matmul_sizes"]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_F32 = np.dtype(np.float32)
#: Scales stay within 2^±100: far inside float32, and past any amax a float32 tensor can hold usefully.
_MAX_EXPONENT = 100.0


class Histories(NamedTuple):
    """Amax histories (float32 ``[length]``, newest first) of one matmul's operands and gradient."""

    lhs: jax.Array
    rhs: jax.Array
    grad: jax.Array


def amax(x: jax.Array) -> jax.Array:
    """The largest magnitude of ``x``, in float32 (NaN if ``x`` holds a NaN, inf if an inf)."""
    return jnp.max(jnp.abs(x)).astype(_F32) if x.size else jnp.zeros([], _F32)


def scale_for(reference: jax.Array, current: jax.Array, dtype: np.dtype) -> jax.Array:
    """The power-of-two factor taking amax ``reference`` near ``dtype``'s largest finite value.

    1 when the reference is 0 (an all-zero tensor); NaN when the tensor's own
    amax ``current`` is not finite, so that every product it enters is NaN.
    """
    exponent = jnp.floor(jnp.log2(float(jnp.finfo(dtype).max)) - jnp.log2(reference))
    scale = jnp.exp2(jnp.clip(exponent, -_MAX_EXPONENT, _MAX_EXPONENT))
    scale = jnp.where(reference > 0, scale, 1.0)
    return jnp.where(jnp.isfinite(current), scale, jnp.nan).astype(_F32)


def quantize(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    """``x * scale`` in ``dtype``, saturating at its largest finite value."""
    bound = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(_F32) * scale, -bound, bound).astype(dtype)


def _reference(history: jax.Array | None, current: jax.Array) -> jax.Array:
    """The amax a scale is chosen from: the history's largest, or the tensor's own
    (current scaling, and delayed scaling's first step, when the history is empty)."""
    if history is None:
        return current
    recorded = jnp.max(history)
    return jnp.where(recorded > 0, recorded, current)


def roll_history(history: jax.Array, current: jax.Array) -> jax.Array:
    """``history`` with ``current`` recorded as its newest entry (the oldest dropped);
    a non-finite amax is not recorded: the history is returned unchanged."""
    rolled = jnp.roll(history, 1).at[0].set(current)
    return jnp.where(jnp.isfinite(current), rolled, history)


def _quantized(x: jax.Array, history: jax.Array | None, dtype: np.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(``x`` in ``dtype``, the scale it was multiplied by, ``x``'s amax)."""
    current = amax(x)
    scale = scale_for(_reference(history, current), current, dtype)
    return quantize(x, scale, dtype), scale, current


# ----------------------------------------------------------------------------- the transposed products


def _remaining(n: int, *used: Sequence[int]) -> list[int]:
    taken = {d for group in used for d in group}
    return [d for d in range(n) if d not in taken]


def transpose_lhs(g: jax.Array, rhs: jax.Array, dims: Any, lhs_ndim: int, out_dtype: Any) -> jax.Array:
    """The gradient with respect to the lhs of ``dot_general(lhs, rhs, dims)`` for output gradient ``g``.

    ``g``'s axes are (batch, lhs free, rhs free); contracting ``g`` with ``rhs``
    over rhs's free axes (and batch with batch) gives (batch, lhs free, lhs
    contracting in rhs's order), which is then permuted into lhs's layout.
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims
    lhs_free = _remaining(lhs_ndim, lhs_contract, lhs_batch)
    rhs_free = _remaining(rhs.ndim, rhs_contract, rhs_batch)
    nb, nl = len(lhs_batch), len(lhs_free)
    g_rhs_free = list(range(nb + nl, nb + nl + len(rhs_free)))
    product = lax.dot_general(g, rhs, ((g_rhs_free, rhs_free), (list(range(nb)), list(rhs_batch))),
                              preferred_element_type=out_dtype)
    # product axes: batch, lhs free, then rhs's contracting axes in rhs order = lhs's contracting axes, paired
    contract_in_rhs_order = [c for _, c in sorted(zip(rhs_contract, lhs_contract))]
    source = [*lhs_batch, *lhs_free, *contract_in_rhs_order]
    return lax.transpose(product, tuple(int(i) for i in np.argsort(source)))


def transpose_rhs(g: jax.Array, lhs: jax.Array, dims: Any, rhs_ndim: int, out_dtype: Any) -> jax.Array:
    """The gradient with respect to the rhs of ``dot_general(lhs, rhs, dims)``:
    :func:`transpose_lhs` of the swapped product (whose output axes are
    (batch, rhs free, lhs free))."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims
    nb = len(lhs_batch)
    n_lhs_free = lhs.ndim - len(lhs_contract) - nb
    n_rhs_free = rhs_ndim - len(rhs_contract) - nb
    swapped_g = lax.transpose(g, (*range(nb), *range(nb + n_lhs_free, nb + n_lhs_free + n_rhs_free),
                                  *range(nb, nb + n_lhs_free)))
    swapped = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    return transpose_lhs(swapped_g, lhs, swapped, rhs_ndim, out_dtype)


def matmul_sizes(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dims: Any) -> tuple[int, int, int]:
    """(M, K, N) of a ``dot_general``: lhs free, contracting and rhs free sizes (batch axes aside)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims
    k = int(np.prod([lhs_shape[d] for d in lhs_contract]))
    m = int(np.prod([lhs_shape[d] for d in _remaining(len(lhs_shape), lhs_contract, lhs_batch)]))
    n = int(np.prod([rhs_shape[d] for d in _remaining(len(rhs_shape), rhs_contract, rhs_batch)]))
    return m, k, n


# ----------------------------------------------------------------------------- the matmul


def _as_dims(dims: Any) -> tuple:
    (lc, rc), (lb, rb) = dims
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def _accumulator(dtype: np.dtype) -> np.dtype:
    """The dtype a product of scaled FP8 values leaves the matmul unit in: ``dtype``,
    except float16, whose range a product of scaled values (448 x 57344 per term) exceeds."""
    return _F32 if np.dtype(dtype) == np.dtype(np.float16) else np.dtype(dtype)


def _unscaled(product: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    """``product / scale`` in ``dtype`` (an exact division: the scale is a power of two)."""
    return (product * (1.0 / scale).astype(product.dtype)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _scaled_dot(lhs, rhs, histories, dims, out_dtype, in_dtypes):
    return _forward(lhs, rhs, histories, dims, out_dtype, in_dtypes)[0]


def _forward(lhs, rhs, histories, dims, out_dtype, in_dtypes):
    q_lhs, s_lhs, a_lhs = _quantized(lhs, histories.lhs if histories else None, E4M3)
    q_rhs, s_rhs, a_rhs = _quantized(rhs, histories.rhs if histories else None, E4M3)
    product = lax.dot_general(q_lhs, q_rhs, dims, preferred_element_type=_accumulator(out_dtype))
    out = _unscaled(product, s_lhs * s_rhs, out_dtype)
    return out, (q_lhs, q_rhs, s_lhs, s_rhs, a_lhs, a_rhs, histories)


def _backward(dims, out_dtype, in_dtypes, residuals, g):
    q_lhs, q_rhs, s_lhs, s_rhs, a_lhs, a_rhs, histories = residuals
    lhs_dtype, rhs_dtype = in_dtypes
    q_g, s_g, a_g = _quantized(g, histories.grad if histories else None, E5M2)
    d_lhs = _unscaled(transpose_lhs(q_g, q_rhs, dims, q_lhs.ndim, _accumulator(lhs_dtype)), s_g * s_rhs, lhs_dtype)
    d_rhs = _unscaled(transpose_rhs(q_g, q_lhs, dims, q_rhs.ndim, _accumulator(rhs_dtype)), s_g * s_lhs, rhs_dtype)
    new = ()
    if histories:  # their "gradient" is the new history (see precision.fp8: the state's update)
        new = Histories(roll_history(histories.lhs, a_lhs), roll_history(histories.rhs, a_rhs),
                        roll_history(histories.grad, a_g))
    return d_lhs, d_rhs, new


def _scaled_dot_fwd(lhs, rhs, histories, dims, out_dtype, in_dtypes):
    return _forward(lhs, rhs, histories, dims, out_dtype, in_dtypes)


_scaled_dot.defvjp(_scaled_dot_fwd, _backward)


def scaled_dot(lhs: jax.Array, rhs: jax.Array, dims: Any, out_dtype: Any,
               histories: Histories | None = None) -> jax.Array:
    """``dot_general(lhs, rhs, dims)`` in FP8, the result in ``out_dtype``.

    Operands are quantized to E4M3 and the output gradient to E5M2, each with
    its own power-of-two scale: from its own amax (``histories=None``, current
    scaling) or from the largest amax of its history (delayed scaling). Under
    differentiation with respect to ``histories``, their cotangent is the new
    histories (this step's amaxes recorded): the train step stores it.
    """
    return _scaled_dot(lhs, rhs, histories if histories is not None else (), _as_dims(dims), np.dtype(out_dtype),
                       (np.dtype(lhs.dtype), np.dtype(rhs.dtype)))
