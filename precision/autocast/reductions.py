"""Gradients of params produced in a chosen dtype: the dtype a data-parallel
gradient reduction runs in.

When a batch is split over devices, a param's gradient is a sum over the batch:
XLA's SPMD partitioner computes each device's part with the op that contracts
the batch (a matmul's weight-gradient product, the sum that transposes a bias's
broadcast, the scatter-add that transposes an embedding lookup) and reduces
the parts across devices right there, *in that op's output dtype*. A cast
written after it does not move the reduction. So choosing the reduction dtype
means choosing the output dtype of those backward ops.

Autocast knows which values are params as a layer reads them (a *leaf*:
:attr:`~precision.autocast.values.Val.leaf`). :func:`bind` binds an op that
reads one through a ``custom_vjp`` whose backward is the primitive's own
transpose rule with, for the param, its product or sum in ``reduce_dtype``:

- ``dot_general`` / ``conv_general_dilated``: the transposed product with
  ``preferred_element_type=reduce_dtype`` (the same half operands; a float32
  accumulator handed over unrounded);
- ``broadcast_in_dim`` / ``gather``: the transposed sum / scatter-add in
  ``reduce_dtype``;
- ``add``, ``sub``, ``mul``, ``div``, ``max``, ``min`` broadcasting a param
  (``x + bias[None, None]``, ``x * scale``): the sum over the broadcast
  dimensions in ``reduce_dtype``.

The gradient reaches the param in the param's own dtype (float32 masters get
float32). Activation gradients are computed as JAX computes them. On one
device a float32 ``reduce_dtype`` changes no product's value (a float32 product
rounded to bfloat16 is the bfloat16 product) but hands it over unrounded and
sums over tokens in float32; across devices the parts are summed in
``reduce_dtype``, which for float32 is what one device computes.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.interpreters import ad

from precision.autocast import program
from precision.autocast.regions import REDUCE_SCOPE_PREFIX
from precision.policy import PolicyError, _canonical

__all__ = ["REDUCING", "MOVES", "reduce_dtype_of", "applies", "bind", "scope_name", "read_scope"]

#: The named scope of a bound op's ``custom_vjp`` call: ``precision_reduce_<dtype>_<leaves>``, by
#: which :mod:`precision.blockwise` binds the same op again on a block of rows (:func:`read_scope`);
#: module paths leave it out (:func:`precision.autocast.regions.module_path`).
SCOPE_PREFIX = REDUCE_SCOPE_PREFIX

#: Primitives whose transposes contract a batch: products given an output dtype...
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})
#: ...linear maps of their first operand transposed by a sum (bias broadcast, embedding lookup)...
_SUMS = frozenset({"broadcast_in_dim", "gather"})
#: ...and elementwise ops, where an operand is broadcast implicitly (``x + bias[None, None]``,
#: ``x * scale``): its cotangent is the full-shape one summed over the broadcast dimensions.
_LINEAR_ELEMENTWISE = frozenset({"add", "sub"})
_ELEMENTWISE = _LINEAR_ELEMENTWISE | {"mul", "div", "max", "min"}
REDUCING = _PRODUCTS | _SUMS | _ELEMENTWISE
_REDUCE_DTYPES = frozenset({np.dtype(np.float32), np.dtype(jax.numpy.bfloat16), np.dtype(np.float16)})
#: Ops that move a value without computing, or cast it: a param through them is still a param (a leaf).
MOVES = program.MOVES | {"convert_element_type"}


def reduce_dtype_of(value: Any) -> np.dtype | None:
    """``None``, or the dtype ``value`` names: float32, bfloat16 or float16
    (``"f32"``, ``"bf16"``, ``"f16"``, their long names, a numpy/JAX dtype);
    anything else raises :class:`precision.PolicyError` naming the valid ones."""
    if value is None:
        return None
    try:
        dtype = _canonical(value)
    except PolicyError:
        dtype = None
    if dtype not in _REDUCE_DTYPES:
        raise PolicyError(f"reduce_dtype: {value!r} is not a dtype gradients can be reduced in; valid: "
                          f"f32, bf16, f16 (or float32, bfloat16, float16)")
    return dtype


def applies(primitive: Any, arrays: Sequence[Any], leaves: Sequence[bool], reduce_dtype: Any) -> bool:
    """Whether ``primitive`` on ``arrays`` (``leaves``: which are params as read)
    gets its params' gradients in ``reduce_dtype``: one of :data:`REDUCING` (an
    elementwise op only where it broadcasts a param), reading a param, its
    floating operands all of one dtype other than ``reduce_dtype`` (a float32
    op too, given a half ``reduce_dtype``: the user asked for half reductions)."""
    name = primitive.name
    if reduce_dtype is None or name not in REDUCING:
        return False
    floats = [np.dtype(a.dtype) for a in arrays if jax.numpy.issubdtype(a.dtype, jax.numpy.floating)]
    if len(set(floats)) != 1 or floats[0] not in _REDUCE_DTYPES or floats[0] == np.dtype(reduce_dtype):
        return False
    if name == "conv_general_dilated" and np.dtype(reduce_dtype).itemsize < floats[0].itemsize:
        return False  # a convolution's result is never narrower than its operands
    if name in _SUMS:
        return bool(leaves[0])
    if name in _ELEMENTWISE:
        return _same_rank(arrays) and any(leaf and _broadcast_axes(a, arrays) for a, leaf in zip(arrays, leaves))
    return any(leaves)


def _same_rank(arrays: Sequence[Any]) -> bool:
    return len({np.ndim(a) for a in arrays}) == 1


def _broadcast_axes(x: Any, arrays: Sequence[Any]) -> tuple[int, ...]:
    """The dimensions along which an elementwise op broadcasts ``x`` (size 1 in ``x`` only)."""
    full = np.broadcast_shapes(*[np.shape(a) for a in arrays])
    return tuple(d for d, (n, m) in enumerate(zip(np.shape(x), full)) if n != m)


def bind(primitive: Any, arrays: Sequence[Any], sources: Sequence[Any], params: dict, reduce_dtype: Any, *,
         input_grad: Any = None, cotangent: Any = None) -> Any:
    """``primitive.bind(*arrays, **params)`` where :func:`applies`, the gradients of
    its params computed in ``reduce_dtype`` (see the module docstring).

    ``sources[i]``: for a param, the array ``arrays[i]`` was cast from (its own,
    float32 for masters); its gradient comes back in that dtype, never rounded
    to half on the way. ``None`` for the other operands (their gradients as JAX
    computes them, or, for a product, made in ``input_grad`` when given: a sum split
    across devices, :mod:`.split_sums`). ``reduce_dtype`` None: no param's gradient is
    made in another dtype. ``cotangent``: the dtype the result's cotangent is taken to
    first (a float32 split sum of half operands: its cotangent back in half)."""
    reduce_dtype = None if reduce_dtype is None else np.dtype(reduce_dtype)
    input_grad = None if input_grad is None else np.dtype(input_grad)
    dtypes = [a.dtype for a in arrays]
    leaves = [s is not None for s in sources]
    inputs = [a if s is None else s for a, s in zip(arrays, sources)]
    keep = primitive.name not in _LINEAR_ELEMENTWISE  # add/sub's cotangents need no operand
    specs = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in arrays)

    def cast(xs):
        return [x if x.dtype == d else x.astype(d) for x, d in zip(xs, dtypes)]

    @jax.custom_vjp
    def op(*xs):
        return primitive.bind(*cast(xs), **params)

    def forward(*xs):
        return op(*xs), (tuple(xs) if keep else None)

    def backward(xs, g):
        operands = cast(xs) if keep else specs
        g = g if cotangent is None else g.astype(cotangent)
        if primitive.name in _PRODUCTS:
            cts = [_product_cotangent(primitive, params, operands, i, g, reduce_dtype if leaf else input_grad)
                   for i, leaf in enumerate(leaves)]
        elif primitive.name in _SUMS:
            cts = [_sum_cotangent(primitive, params, operands, g, reduce_dtype)] + [None] * (len(xs) - 1)
        else:
            cts = _elementwise_cotangents(primitive, params, operands, leaves, g, reduce_dtype)
        return tuple(None if ct is None else ct.astype(x.dtype) for ct, x in zip(cts, inputs))

    op.defvjp(forward, backward)
    with jax.named_scope(scope_name(reduce_dtype or dtypes[0], leaves)):
        return op(*inputs)


def scope_name(reduce_dtype: Any, leaves: Sequence[bool]) -> str:
    """The named scope :func:`bind` calls its op in: the reduce dtype and which operands are params."""
    return f"{SCOPE_PREFIX}{np.dtype(reduce_dtype).name}_{''.join('1' if leaf else '0' for leaf in leaves)}"


def read_scope(name: str) -> tuple[np.dtype, list[bool]] | None:
    """``(reduce_dtype, leaves)`` from a scope :func:`scope_name` made (None for another scope)."""
    if not name.startswith(SCOPE_PREFIX):
        return None
    dtype, _, leaves = name[len(SCOPE_PREFIX):].rpartition("_")
    return np.dtype(dtype), [c == "1" for c in leaves]


def _undefined(x: Any, dtype: Any = None) -> ad.UndefinedPrimal:
    return ad.UndefinedPrimal(jax.core.ShapedArray(x.shape, dtype or x.dtype))


def _product_cotangent(primitive: Any, params: dict, xs: Sequence[Any], i: int, g: Any,
                       reduce_dtype: np.dtype | None) -> Any:
    """The cotangent of operand ``i`` of a product: its transpose with a ``reduce_dtype``
    result (``None``: the transpose JAX takes, in the operand's dtype).

    XLA's CPU runtime lacks some half x half -> float32 products, so a program
    lowered for the CPU widens the operands first: the same value (half values
    are exact in float32, and the product accumulates in float32 either way).
    Decided by the platform the program is lowered for (a GPU gets the half x
    half product, even compiled from a CPU host), so each lowering holds one
    product."""
    def transpose(g, *operands):
        args = [_undefined(x) if j == i else x for j, x in enumerate(operands)]
        updates = {} if reduce_dtype is None else {"preferred_element_type": reduce_dtype}
        cotangents = ad.get_primitive_transpose(primitive)(g, *args, **{**params, **updates})
        return cotangents[i].astype(reduce_dtype or xs[i].dtype)

    if reduce_dtype is None:
        return transpose(g, *xs)

    def widened(g, *operands):
        wide = [x.astype(reduce_dtype) if x.dtype.itemsize < reduce_dtype.itemsize else x for x in operands]
        return transpose(g.astype(wide[0].dtype), *wide)

    return jax.lax.platform_dependent(g, *xs, cpu=widened, default=transpose)


def _sum_cotangent(primitive: Any, params: dict, xs: Sequence[Any], g: Any, reduce_dtype: np.dtype) -> Any:
    """The cotangent of a broadcast's or gather's operand, summed in ``reduce_dtype``.

    Transposed through :func:`jax.linear_transpose` rather than the primitive's
    registered rule: jax 0.11 registers gather's transpose where
    ``ad.get_primitive_transpose`` no longer finds it."""
    rest = xs[1:]
    pull = jax.linear_transpose(lambda x: primitive.bind(x, *rest, **params),
                                jax.ShapeDtypeStruct(np.shape(xs[0]), reduce_dtype))
    return pull(g.astype(reduce_dtype))[0]


def _elementwise_cotangents(primitive: Any, params: dict, xs: Sequence[Any], leaves: Sequence[bool], g: Any,
                            reduce_dtype: np.dtype) -> list:
    """Each operand's full-shape cotangent (in the op's dtype, as JAX computes it),
    summed over the dimensions it was broadcast along: in ``reduce_dtype`` for a param."""
    full = g.shape
    if primitive.name in _LINEAR_ELEMENTWISE:
        pull = jax.linear_transpose(lambda *ys: primitive.bind(*ys, **params),
                                    *[jax.ShapeDtypeStruct(full, x.dtype) for x in xs])
    else:
        _, pull = jax.vjp(lambda *ys: primitive.bind(*ys, **params),
                          *[jax.numpy.broadcast_to(x, full) for x in xs])
    out = []
    for x, leaf, ct in zip(xs, leaves, pull(g)):
        axes = _broadcast_axes(x, xs)
        if axes:  # summed in exactly this dtype (jnp.sum would widen a half sum, moving the reduction)
            ct = ct.astype(reduce_dtype if leaf else ct.dtype)
            ct = jax.lax.reduce(ct, np.zeros((), ct.dtype), jax.lax.add, axes).reshape(np.shape(x))
        out.append(ct)
    return out
