"""The float32 loss of a classifier or a language model: softmax cross-entropy with
integer labels, written for the memory large logits cost.

:func:`cross_entropy` is the built-in tasks' loss (``train.cross_entropy``). Its
custom VJP call carries a named scope (:data:`CROSS_ENTROPY_SCOPE`)
by which :func:`precision.blockwise_loss` recognizes it and computes it again on each
block of rows (:func:`cross_entropy_core`: the same function, fewer rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.lax import platform_dependent

__all__ = ["CROSS_ENTROPY_SCOPE", "cross_entropy", "cross_entropy_core"]

#: The named scope of :func:`cross_entropy`'s custom-VJP call.
CROSS_ENTROPY_SCOPE = "precision_cross_entropy"


def cross_entropy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-example (or per-token) float32 cross-entropy and correctness (the label is the
    first largest logit, as ``argmax``).

    Equal to optax's ``softmax_cross_entropy_with_integer_labels`` (and ``argmax``), written
    for the memory a language model's ``[tokens, vocabulary]`` logits cost (3.3 GB in float32
    at GPT-2-small's vocabulary and 16 x 1024 tokens, each pass over them a millisecond on an
    H100): the forward reads them twice, the maximum and its first position in one reduction
    (correctness without an ``argmax`` pass of its own), then the sum of exponentials against
    that maximum, one exponential a logit. One online-softmax pass (the three folded together)
    reads them once but evaluates two exponentials a logit: on an H200 it took 1.685 ms forward,
    2.250 ms with the gradient, the two passes 1.223 and 2.017 ms (GPT-2 small's bf16 logits,
    ``benchmarks/results/loss-variants-nvidia-h200-2026-11-30.md``). On a TPU the one pass (with one
    exponential a logit) stays: there XLA fuses it with the head's matmul output as it fuses the
    maximum alone, and by its own cost model the second pass adds 2.9% to GPT-2 small's v5e step
    (no TPU has timed either). The gradient
    ``softmax - one_hot(labels)`` is one elementwise expression that XLA fuses with what reads
    it (the head's bias and weight gradients) rather than a float32 array written, scattered
    into (the label's gather transposed) and read again.
    """
    with jax.named_scope(CROSS_ENTROPY_SCOPE):  # precision.blockwise_loss computes it a block of rows at a time
        return _cross_entropy(logits.astype(jnp.float32), labels.astype(jnp.int32))


@jax.custom_vjp
def _cross_entropy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _cross_entropy_fwd(logits, labels)[0]


def _cross_entropy_fwd(logits: jax.Array, labels: jax.Array) -> tuple:
    log_total, first = _log_sum_exp_and_first(logits)
    label_logit = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return (log_total - label_logit, first == labels), (logits, labels, log_total)


def _cross_entropy_bwd(residuals: tuple, cotangents: tuple) -> tuple:
    logits, labels, log_total = residuals
    positions = _positions(logits)
    one_hot = (positions == labels[..., None]).astype(logits.dtype)
    softmax = jnp.exp(logits - log_total[..., None])
    return cotangents[0][..., None] * (softmax - one_hot), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def _log_sum_exp_and_first(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``logsumexp`` over the last axis and the first position of its maximum: in one pass on a
    TPU (:func:`_one_pass`), in two everywhere else (:func:`_two_passes`). A row all -inf gives
    -inf (its loss NaN, as optax's); a +inf or NaN logit gives NaN."""
    return platform_dependent(logits, tpu=_one_pass, default=_two_passes)


def _two_passes(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The maximum and its first position in one (variadic) reduction, then ``logsumexp``
    against that maximum: one exponential a logit, the logits read twice (what an H200 ran
    fastest, :func:`cross_entropy`)."""
    positions = _positions(logits)
    init = (jnp.asarray(-jnp.inf, logits.dtype), jnp.asarray(logits.shape[-1], jnp.int32))
    peak, first = jax.lax.reduce((logits, positions), init, _first_maximum, (logits.ndim - 1,))
    shift = jnp.where(peak == -jnp.inf, 0.0, peak)  # exp(-inf - -inf) is NaN
    return shift + jnp.log(jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1)), first


def _one_pass(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Logsumexp and the first maximum in one (online-softmax) reduction: each logit folds into a
    running (maximum, sum of ``exp(x - maximum)``, first position) by :func:`_fold_one_exp`. The
    logits are read once, for one exponential a logit. On a TPU XLA fuses this fold with the head's
    matmul output as it fuses the maximum alone, where the second pass of :func:`_two_passes` is a
    fusion of its own (GPT-2 small's v5e step: 7.7 of 263 ms, by XLA's own estimate)."""
    positions = _positions(logits)
    # each logit a sum of 1 at its own maximum; made from the logits, as _positions is, so that
    # a loop over blocks of rows keeps no logits-sized constant
    ones = jnp.where(jnp.isnan(logits), 1.0, 1.0).astype(logits.dtype)
    init = (jnp.asarray(-jnp.inf, logits.dtype), jnp.zeros([], logits.dtype), jnp.asarray(logits.shape[-1], jnp.int32))
    peak, total, first = jax.lax.reduce((logits, ones, positions), init, _fold_one_exp, (logits.ndim - 1,))
    return jnp.where(peak == jnp.inf, jnp.nan, peak + jnp.log(total)), first


def _fold_one_exp(a: tuple, b: tuple) -> tuple:
    """Two (maximum, sum of exponentials against it, first position) triples as one: the smaller
    side's sum scaled by ``exp(-|peak_a - peak_b|)``, one exponential (0 for a side that has seen
    only -inf beside a finite maximum; equal maxima, -inf ones too, add their sums unscaled)."""
    (peak_a, total_a, first_a), (peak_b, total_b, first_b) = a, b
    peak, first = _first_maximum((peak_a, first_a), (peak_b, first_b))
    scale = jnp.exp(jnp.where(peak_a == peak_b, 0.0, -jnp.abs(peak_a - peak_b)))
    total = jnp.where(peak_a >= peak_b, total_a + total_b * scale, total_a * scale + total_b)
    return peak, total, first


def _positions(logits: jax.Array) -> jax.Array:
    """Each logit's position on the last axis, made from the logits (NaN ones one further on,
    where the loss is NaN either way) and a vocabulary-long iota: nothing logits-sized that
    does not depend on the logits, which a loop over blocks of rows would compute once and
    keep (JAX hoists a scan's loop-invariant values out of it); fused into the pass that reads them."""
    iota = jax.lax.iota(jnp.int32, logits.shape[-1])
    return iota + jnp.isnan(logits).astype(jnp.int32)


def _first_maximum(a: tuple, b: tuple) -> tuple:
    """The larger of two (maximum, first position) pairs; of equal maxima, the first position."""
    (peak_a, first_a), (peak_b, first_b) = a, b
    first = jnp.where(peak_a == peak_b, jnp.minimum(first_a, first_b), jnp.where(peak_a > peak_b, first_a, first_b))
    return jnp.maximum(peak_a, peak_b), first


def cross_entropy_core(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`cross_entropy` on float32 logits and int32 labels, without its named scope."""
    return _cross_entropy(logits, labels)
