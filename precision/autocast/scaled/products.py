"""What FP8 and int8 products share: the transposed products of a ``dot_general`` (its
two gradients, each a product of the output gradient with the other operand), its
M, K, N, and an operand's axis-wise scales laid out like the product's output."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax

__all__ = ["Product", "transpose_lhs", "transpose_rhs", "matmul_sizes", "in_output_layout", "remaining",
           "attention_or_size", "operand_dtypes", "gradient_dtypes"]

Product = Callable[[jax.Array, jax.Array, Any], jax.Array]  # (a, b, dims) -> dot_general(a, b, dims), however made


def remaining(n: int, *used: Sequence[int]) -> list[int]:
    """The axes of an n-dimensional operand not in any of the ``used`` groups, in order."""
    taken = {d for group in used for d in group}
    return [d for d in range(n) if d not in taken]


def _plain(out_dtype: Any) -> Product:
    return lambda a, b, dims: lax.dot_general(a, b, dims, preferred_element_type=out_dtype)


def transpose_lhs(g: jax.Array, rhs: jax.Array, dims: Any, lhs_ndim: int, out_dtype: Any = None,
                  product: Product | None = None) -> jax.Array:
    """The gradient with respect to the lhs of ``dot_general(lhs, rhs, dims)`` for output gradient ``g``.

    ``g``'s axes are (batch, lhs free, rhs free); contracting ``g`` with ``rhs``
    over rhs's free axes (and batch with batch) gives (batch, lhs free, lhs
    contracting in rhs's order), which is then permuted into lhs's layout.
    ``product`` makes that contraction (default: a plain ``dot_general`` into ``out_dtype``).
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims
    lhs_free = remaining(lhs_ndim, lhs_contract, lhs_batch)
    rhs_free = remaining(rhs.ndim, rhs_contract, rhs_batch)
    nb, nl = len(lhs_batch), len(lhs_free)
    g_rhs_free = tuple(range(nb + nl, nb + nl + len(rhs_free)))
    result = (product or _plain(out_dtype))(g, rhs, ((g_rhs_free, tuple(rhs_free)), (tuple(range(nb)), tuple(rhs_batch))))
    # result axes: batch, lhs free, then rhs's contracting axes in rhs order = lhs's contracting axes, paired
    contract_in_rhs_order = [c for _, c in sorted(zip(rhs_contract, lhs_contract))]
    source = [*lhs_batch, *lhs_free, *contract_in_rhs_order]
    return lax.transpose(result, tuple(int(i) for i in np.argsort(source)))


def transpose_rhs(g: jax.Array, lhs: jax.Array, dims: Any, rhs_ndim: int, out_dtype: Any = None,
                  product: Product | None = None) -> jax.Array:
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
    return transpose_lhs(swapped_g, lhs, swapped, rhs_ndim, out_dtype, product)


def matmul_sizes(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dims: Any) -> tuple[int, int, int]:
    """(M, K, N) of a ``dot_general``: lhs free, contracting and rhs free sizes (batch axes aside)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims
    k = int(np.prod([lhs_shape[d] for d in lhs_contract]))
    m = int(np.prod([lhs_shape[d] for d in remaining(len(lhs_shape), lhs_contract, lhs_batch)]))
    n = int(np.prod([rhs_shape[d] for d in remaining(len(rhs_shape), rhs_contract, rhs_batch)]))
    return m, k, n


def in_output_layout(scale: jax.Array, contract: Sequence[int], batch: Sequence[int], leading: int,
                      trailing: int) -> jax.Array:
    """An operand's axis-wise scales (its shape, contracted axes of size 1) laid out for a
    ``dot_general`` output (batch, lhs free, rhs free): batch axes first, its free axes,
    size-1 axes for the other operand's ``trailing`` free axes (``leading`` of them before
    its own when it is the rhs)."""
    free = remaining(scale.ndim, contract, batch)
    moved = lax.transpose(scale, (*batch, *free, *contract))
    kept = moved.reshape(moved.shape[:len(batch) + len(free)])
    nb = len(batch)
    return kept.reshape((*kept.shape[:nb], *([1] * leading), *kept.shape[nb:], *([1] * trailing)))


def attention_or_size(eqn: Any, ins: list, attention: bool, min_size: int, name: str,
                      sizes: tuple[int, int, int] | None = None) -> str | None:
    """Why a matmul stays out of an 8-bit format ``name`` (``"fp8"``, ``"int8"``): attention's
    batched product of two activations (unless ``attention``), or one of its M, K, N (``sizes``,
    default a ``dot_general``'s) below ``min_size``; None where neither keeps it out."""
    if sizes is None:
        dims = eqn.params["dimension_numbers"]
        if not attention and dims[1][0] and not any(v.leaf for v in ins):
            return (f"attention stays out of {name} (a batched product of two activations; {name} attention=true "
                    "takes it)")
        sizes = matmul_sizes(eqn.invars[0].aval.shape, eqn.invars[1].aval.shape, dims)
    m, k, n = sizes
    if min(m, k, n) < min_size:
        return f"below {name} min_size {min_size} (M x K x N = {m}x{k}x{n})"
    return None


def operand_dtypes(lhs: jax.Array, rhs: jax.Array, grad_dtypes: tuple[Any, Any] | None) -> tuple:
    """((lhs dtype, rhs dtype), (the dtypes their gradients' products are made in: ``grad_dtypes``,
    default the operands')): a scaled product's static ``in_dtypes``."""
    own = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    return own, own if grad_dtypes is None else tuple(np.dtype(d) for d in grad_dtypes)


def gradient_dtypes(ins: list, arrays: tuple, reduce_dtype: Any = None, input_grad: Any = None,
                    param_target: Any = None) -> tuple:
    """The dtypes a scaled product's two gradients are made in, for operands ``ins`` (autocast's
    values) read as ``arrays``: a param's in ``reduce_dtype`` when given, else no wider than
    ``param_target`` (when given: the fallback's dtype, as its matmul makes it on the cast param);
    another operand's in ``input_grad`` when given (a sum split across devices); else each in
    its operand's own dtype."""
    def one(v: Any, x: Any) -> np.dtype:
        own = np.dtype(x.dtype)
        if not v.leaf:
            return own if input_grad is None else np.dtype(input_grad)
        if reduce_dtype is not None:
            return np.dtype(reduce_dtype)
        narrower = param_target is not None and own.itemsize > np.dtype(param_target).itemsize
        return np.dtype(param_target) if narrower else own

    return tuple(one(v, x) for v, x in zip(ins, arrays))
