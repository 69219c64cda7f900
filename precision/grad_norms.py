"""The wrapper's finiteness check and global norm, in as few passes and kernels as it can.

:func:`precision.mixed_precision` must know every gradient is finite before it writes an
update, and reports the global norm and the first non-finite leaf. Two ways:

- :func:`check_gradients`: every gradient read once by a handful of reductions (leaves
  concatenated, the concatenation fused into the reduction that reads it, never written
  out), which also find the first leaf holding a non-finite element and the leaf holding
  the largest one. On the H100 program of a GPT-2-small step: 11 kernels, where a
  reduction per large leaf was 108 (a hand-written step without a check has none);
- :func:`leaf_squared_norms`: one float32 sum of squares per leaf, for gradients split
  over devices (each device reduces its own shards; a concatenation would gather them)
  and for XLA:CPU, whose library sums are faster than one long loop.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SMALL_LEAF", "LEAVES_PER_REDUCTION", "GradientCheck", "check_gradients", "leaf_squared_norms",
           "leaf_check", "checked_nonfinite_leaf"]

#: Leaves one reduction of :func:`check_gradients` reads: XLA's GPU compiler fuses a
#: concatenation of up to about 40 operands into the reduction that reads it (measured on the
#: H100 program of a GPT-2-small step); past that it writes the concatenation out first, a
#: copy of every gradient.
LEAVES_PER_REDUCTION = 32
#: Row width of :func:`check_gradients`' partial reductions: a group of leaves is reduced
#: row by row (one kernel), the rows of every group then together (one more).
_ROW = 16384
_SHORT_ROW = 1024  # rows of a group of vectors shorter than four long rows
#: Leaves of at least this many dimensions (convolution kernels) are read output channel first,
#: flattened: the order cuDNN writes a filter gradient in (OHWI), so the concatenation of every
#: kernel's is read as it lies, by one reduction. A reduction per kernel (XLA makes each two)
#: was 27 more kernels in the H100 program of the suite's ResNet step.
_CONV_NDIM = 4
_NONE = np.int32(2 ** 31 - 1)  # "no leaf" in the index reductions


#: Leaves of at most this many elements (biases, norm scales) are reduced together, the
#: leaves of one size as the rows of one matrix: a kernel per size instead of per leaf.
SMALL_LEAF = 1 << 14


def leaf_squared_norms(grads: Any, one_loop: bool = False) -> jax.Array:
    """Per leaf, the float32 sum of squares, as a vector: non-finite iff an element is (or
    the sum overflows).

    ``one_loop``: as two-output reductions (:func:`_sum_and_peak`) that read each leaf once
    as it is stored, small leaves (at most :data:`SMALL_LEAF` elements) of one size in
    one. A GPT-2-small step has ~150 leaves, two thirds of them small: a reduction and a
    select per leaf were 230 more kernel launches (of microseconds each on a GPU) in its
    H100 program than now.
    """
    leaves = [jnp.asarray(g) for g in jax.tree_util.tree_leaves(grads)]
    if not leaves:
        return jnp.zeros([1], jnp.float32)
    if not one_loop:
        return jnp.stack([jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves])
    order = [i for i, g in enumerate(leaves) if g.size > SMALL_LEAF]
    parts = [_sum_and_peak(leaves[i].astype(jnp.float32)) for i in order]
    by_size: dict[int, list[int]] = {}
    for i, g in enumerate(leaves):
        if g.size <= SMALL_LEAF:
            by_size.setdefault(g.size, []).append(i)
    for size, group in by_size.items():  # same-sized small leaves as the rows of one matrix
        rows = jnp.stack([leaves[i].astype(jnp.float32).reshape(size) for i in group])
        parts.append(_sum_and_peak(rows, axis=1))
        order += group
    totals = jnp.concatenate([jnp.atleast_1d(t) for t, _ in parts])
    peaks = jnp.concatenate([jnp.atleast_1d(p) for _, p in parts])
    squares = jnp.where(jnp.isfinite(peaks), totals, totals + peaks)
    return squares[np.argsort(order)] if order != list(range(len(leaves))) else squares


class GradientCheck(NamedTuple):
    """What :func:`check_gradients` finds in one pass over the gradients."""

    squares: jax.Array  # float32 sum of squares of every element: non-finite iff one is, or it overflows
    first_nonfinite: jax.Array  # int32 index of the first leaf holding a non-finite element; -1 if none
    largest: jax.Array  # int32 index of the leaf holding the largest magnitude (or the largest norm)


def leaf_check(grads: Any, one_loop: bool = False) -> GradientCheck:
    """:class:`GradientCheck` from a sum of squares per leaf (:func:`leaf_squared_norms`): a
    leaf whose own squares overflow counts as non-finite; ``largest``: the largest norm."""
    squares = leaf_squared_norms(grads, one_loop)
    finite = jnp.isfinite(squares)
    first = jnp.where(jnp.all(finite), -1, jnp.argmin(finite)).astype(jnp.int32)
    return GradientCheck(jnp.sum(squares), first, jnp.argmax(squares).astype(jnp.int32))


def check_gradients(grads: Any) -> GradientCheck:
    """The float32 sum of squares of all of ``grads``, the first leaf (in ``tree_leaves``
    order) holding a non-finite element, and the leaf holding the largest magnitude,
    reading each gradient once.

    Leaves are concatenated in groups of at most :data:`LEAVES_PER_REDUCTION`, matrices of
    one width along their rows, vectors end to end, with each element's leaf index beside
    it; one four-output reduction per group reduces its rows (the concatenation fused into
    it, never written out), one more (XLA makes it two) the rows of every group. Leaves of
    four or more dimensions (convolution kernels) are flattened output channel first and
    concatenated, like vectors (see :data:`_CONV_NDIM`). On the
    H100 program of a GPT-2-small step: 11 kernels. For gradients on one device or replicated: a
    concatenation of leaves split over devices would gather them (use
    :func:`leaf_squared_norms` there).
    """
    leaves = [jnp.asarray(g) for g in jax.tree_util.tree_leaves(grads)]
    zero = jnp.zeros([], jnp.float32)
    init = (zero, zero, jnp.asarray(_NONE), jnp.asarray(_NONE))
    by_width: dict[int, list[tuple[int, jax.Array]]] = {}
    groups = []
    for i, g in enumerate(leaves):
        if not g.size:
            continue
        if g.ndim >= _CONV_NDIM:  # a convolution's kernel, output channels first: as cuDNN writes it
            by_width.setdefault(-1, []).append((i, jnp.moveaxis(g, -1, 0).reshape(1, -1)))
        else:  # matrices (and 3-D kernels) by their last dimension, whatever their layout; vectors flattened
            matrix = g.reshape(-1, g.shape[-1]) if g.ndim >= 2 else g.reshape(1, -1)
            by_width.setdefault(matrix.shape[1] if g.ndim >= 2 else 0, []).append((i, matrix))
    for width, members in by_width.items():
        for start in range(0, len(members), LEAVES_PER_REDUCTION):
            part = members[start:start + LEAVES_PER_REDUCTION]
            groups.append(_reduce_rows(part, flat=width <= 0, init=init))
    if not groups:
        return GradientCheck(zero, jnp.asarray(-1, jnp.int32), jnp.zeros([], jnp.int32))
    rows = tuple(jnp.concatenate(parts) for parts in zip(*groups))
    squares, _, largest, first = jax.lax.reduce(rows, init, _combine, (0,))
    return GradientCheck(squares, jnp.where(first == _NONE, -1, first), jnp.where(largest == _NONE, 0, largest))


def _reduce_rows(part: list[tuple[int, jax.Array]], flat: bool, init: tuple) -> tuple:
    """Leaves ``(index, matrix)`` stacked along their rows (matrices of one width: no
    reshape that would need them row-major, so a gradient a GEMM wrote transposed is read
    as it is) or, for vectors, end to end in rows; reduced row by row (a column reduction
    would not fuse the squares into it: XLA's GPU compiler writes them out first)."""
    if flat:
        values = jnp.concatenate([m.reshape(-1).astype(jnp.float32) for _, m in part])
        index = jnp.concatenate([jnp.full((m.size,), i, jnp.int32) for i, m in part])
        row = _ROW if values.size >= 4 * _ROW else _SHORT_ROW
        pad = -values.size % row
        if pad:
            values = jnp.concatenate([values, jnp.zeros((pad,), jnp.float32)])
            index = jnp.concatenate([index, jnp.full((pad,), _NONE, jnp.int32)])
        values, index = values.reshape(-1, row), index.reshape(-1, row)
    else:
        values = jnp.concatenate([m.astype(jnp.float32) for _, m in part])
        index = jnp.concatenate([jnp.full(m.shape, i, jnp.int32) for i, m in part])
    bad = jnp.where(jnp.isfinite(values), _NONE, index)
    return jax.lax.reduce((jnp.square(values), jnp.abs(values), index, bad), init, _combine, (1,))


def _combine(a: tuple, b: tuple) -> tuple:
    """(sum of squares, peak, leaf of the peak, first non-finite leaf) of two parts."""
    b_larger = b[1] > a[1]
    return (a[0] + b[0], jnp.where(b_larger, b[1], a[1]), jnp.where(b_larger, b[2], a[2]), jnp.minimum(a[3], b[3]))


def checked_nonfinite_leaf(check: GradientCheck, finite: jax.Array) -> jax.Array:
    """``nonfinite_leaf`` (see :class:`MixedPrecisionState`) from a check: the first
    non-finite leaf; ``-2 - i`` when every element is finite but the sum of squares
    overflowed, leaf ``i`` the largest; -1 when ``finite``."""
    culprit = jnp.where(check.first_nonfinite >= 0, check.first_nonfinite,
                        jnp.where(jnp.isfinite(check.squares), -1, -2 - check.largest))
    return jnp.where(finite, -1, culprit).astype(jnp.int32)


def _sum_and_peak(g: jax.Array, axis: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The sum of squares of float32 ``g`` and its largest magnitude, over ``axis`` (None:
    all), as one two-output reduction that reads ``g`` once.

    XLA:CPU hands a plain sum to a library kernel (YNNPACK) that needs its operand in
    memory, so it first writes the float32 squares out and reads them back: 5x the bytes
    of a half gradient, the most expensive pass of a select-skipped update. The two-output
    reduction is one loop instead; it moves the fewest bytes, though on CPU the loop
    (single-threaded, strided through a transposed gradient) takes longer than the library
    sum: the cond strategy, CPU's default, keeps the plain sum. The max is used (the sum is
    non-finite whenever the max is, and ``total + peak`` is then that same inf or nan), so
    XLA keeps the pair.
    """
    axes = tuple(range(g.ndim)) if axis is None else (axis,)
    if g.size == 0:
        shape = tuple(n for d, n in enumerate(g.shape) if d not in axes)
        return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
    zero = jnp.zeros([], jnp.float32)
    return jax.lax.reduce((jnp.square(g), jnp.abs(g)), (zero, zero),
                          lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), axes)
