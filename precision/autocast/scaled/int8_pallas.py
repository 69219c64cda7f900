"""Int8 matmuls for a TPU with the quantization inside the kernel: no extra HBM pass.

The XLA recipe (:mod:`.int8_matmul`) quantizes each 16-bit operand in fusions of
its own: one pass reads the activation for its row absmax, another reads it again
and writes an int8 copy, and only then does the matrix unit read that copy. On a
TPU v5e those memory-bound passes cost about what the int8 rate saves. These
Pallas (Mosaic) kernels read the 16-bit operand once, into VMEM, and quantize it
there:

- :func:`rows_matmul` ``(M, K) x (K, N)``: a block of ``bm`` rows of the 16-bit
  ``x`` (all ``K``), its per-row ``absmax / 127`` and int8 values computed in VMEM
  (once per row block, kept in scratch across the output's column blocks),
  multiplied by an int8 weight block into int32 and dequantized into the output
  dtype. The weight is quantized per column by XLA (small). The forward product
  and the input's gradient (``g . wᵀ``, ``g``'s rows quantized) are both this
  kernel, with the same arithmetic as the recipe: bit for bit the same values.
- :func:`tiles_matmul` ``xᵀ . g`` (the weight's gradient, contracting the ``M``
  tokens): no block sees a whole column of 16,384 tokens, so each block of ``bm``
  tokens is quantized per column with its own scales (1 x ``bm`` tiles, as Jetfire
  and DeepSeek-V3 do), its int32 partial product scaled and accumulated in float32
  across the blocks. Close to the recipe (per-column scales over all tokens), not
  the same values.
- :func:`row_tiles_matmul` ``(M, C) x (N, C)ᵀ``: the rows of ``x`` quantized in
  tiles along ``C``, for a ``C`` too wide for one block (a language model head's
  input gradient contracts the vocabulary); the weight per row, by XLA.

Both carry a ``cost_estimate`` (their FLOPs, and the bytes they move in HBM: each
operand once per block that reads it, the result once), and run under the scope
:data:`SCOPE`, by which :mod:`train.inspections.tpu_time` counts them as int8
matmuls. ``interpret=True`` runs them on a CPU (Pallas's interpreter: the tests).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from precision.autocast.scaled.int8_blocks import (_cdiv, _token_block, heads_blocks, row_tiles_blocks, rows_blocks,
                                                   tiles_blocks)
from precision.autocast.scaled.int8_quantize import F32, INT8, INT32, QMAX

__all__ = ["SCOPE", "ROWS", "TILES", "ROW_TILES", "module_path", "rows_blocks", "heads_blocks", "tiles_blocks",
           "row_tiles_blocks", "rows_matmul", "tiles_matmul", "row_tiles_matmul", "as_matrix", "prologue_rows"]

#: The scope the kernels are traced in (what the TPU step model reads in their custom calls' op_name).
SCOPE = "int8_pallas_matmul"
ROWS, TILES, ROW_TILES = "int8_rows_matmul", "int8_tiles_matmul", "int8_row_tiles_matmul"  # the kernels' names


def module_path(path: str) -> str:
    """A kernel's module path (``block_0/Dense_0/int8_pallas_matmul/int8_rows_matmul``) as its
    matmul's (``block_0/Dense_0``)."""
    for name in (f"/{TILES}", f"/{ROWS}", f"/{ROW_TILES}", f"/{SCOPE}"):
        path = path.removesuffix(name)
    return path


#: A v5e core's VMEM is 128 MiB; what a kernel may take of it (its double-buffered blocks and scratch).
_VMEM_LIMIT = 96 * 2**20
_CHUNK = 2048
_REDUCING = ("parallel", "parallel", "arbitrary")  # a grid whose last axis sums into the output block


def _scale(amax: jax.Array) -> jax.Array:
    """``absmax / 127`` as float32: 1 for an all-zero slice, NaN for a non-finite one (the recipe's)."""
    amax = amax.astype(F32)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan).astype(F32)


def _quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` rounded to nearest into int8 [-127, 127] (the recipe's)."""
    return jnp.clip(jnp.round(x.astype(F32) / scale), -QMAX, QMAX).astype(INT32).astype(INT8)


def _scaled(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """(int8 values, float32 scales) of ``x`` per slice along ``axis``: the recipe's
    :func:`.int8_quantize.quantized_along` (absmax / 127, rounded to nearest), in VMEM."""
    scale = _scale(jnp.max(jnp.abs(x), axis=axis, keepdims=True))
    return _quantize(x, scale), scale


def _row_pieces(x_ref: Any, prologue: Callable | None = None, whole: bool = False
                ) -> list[tuple[Callable[[], jax.Array], int, int]]:
    """A row block's columns in pieces (each read when called, its first and last column): chunks of a
    rows' block (float32 copies of a chunk at a time; ``whole``: one, the whole rows), or each head of a
    heads-first one; ``prologue``: applied to each piece read, in float32 (an activation:
    :mod:`.int8_activation`; a norm, on whole rows: :mod:`.int8_norm`)."""
    if len(x_ref.shape) == 4:  # (1, heads, rows, head size)
        width = x_ref.shape[3]
        return [(lambda h=h: x_ref[0, h], h * width, (h + 1) * width) for h in range(x_ref.shape[1])]
    k = x_ref.shape[1]
    read = (lambda a, b: x_ref[:, a:b]) if prologue is None else (lambda a, b: prologue(x_ref[:, a:b].astype(F32)))
    chunk = k if whole else _CHUNK
    return [(lambda a=a, b=b: read(a, b), a, b) for a, b in ((c, min(c + chunk, k)) for c in range(0, k, chunk))]


def _quantized_rows(pieces: list, qx_ref: Any, sx_ref: Any) -> None:
    """The row block's pieces quantized per row into ``qx_ref``, their scales into ``sx_ref``: each piece
    read twice (its absmax, then its values), or, one piece, once."""
    if len(pieces) == 1:
        x = pieces[0][0]()
        scale = _scale(jnp.max(jnp.abs(x), axis=1, keepdims=True))
        qx_ref[...] = _quantize(x, scale)
    else:
        amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(read()), axis=1, keepdims=True) for read, _, _ in pieces])
        scale = _scale(amax)
        for read, a, b in pieces:
            qx_ref[:, a:b] = _quantize(read(), scale)
    sx_ref[...] = scale


def _rows_kernel(x_ref, qw_ref, sw_ref, *refs, weight_rows: bool, bias: bool, heads: int = 0,
                 prologue: Any = None, epilogue: Any = None, params: int = 0):
    b_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
    e_ref, refs = (refs[0], refs[1:]) if epilogue else (None, refs)  # e: what the activation read
    p_refs, (o_ref, *refs) = refs[:params], refs[params:]  # p: the activation's params, (1, columns) each
    d_refs, (qx_ref, sx_ref) = (refs[:params], refs[params:]) if epilogue else ((), refs)  # d: their gradients
    read_params = lambda: [p[...].astype(F32) for p in p_refs]  # noqa: E731

    @pl.when(pl.program_id(1) == 0)  # the row block quantized once, reused by every column block
    def _():
        act = None if prologue is None else (lambda x: prologue(x, *read_params()))
        _quantized_rows(_row_pieces(x_ref, act, prologue is not None and prologue.row_wise), qx_ref, sx_ref)

    contract = 1 if weight_rows else 0  # the weight block's axis the product contracts
    acc = jax.lax.dot_general(qx_ref[...], qw_ref[...], (((1,), (contract,)), ((), ())), preferred_element_type=INT32)
    y = acc.astype(F32) * (sx_ref[...] * sw_ref[...])
    y = y + b_ref[...].astype(F32) if bias else y
    if epilogue:  # through the activation: x's gradient, and its params' summed over this block's rows
        y, *d_params = epilogue.backward(e_ref[...].astype(F32), y, *read_params())
        for d_ref, d in zip(d_refs, d_params):
            d_ref[...] = d.reshape(d_ref.shape)
    y = y.astype(o_ref.dtype)
    if not heads:
        o_ref[...] = y
        return
    width = y.shape[1] // heads
    for h in range(heads):  # heads-first: each head's columns a (rows, head size) block of its own
        o_ref[0, h] = y[:, h * width:(h + 1) * width]


def _compiler_params(semantics: tuple[str, ...]) -> Any:
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=_VMEM_LIMIT)


def rows_matmul(x: jax.Array, q_w: jax.Array, s_w: jax.Array, out_dtype: Any, interpret: bool = False,
                weight_rows: bool = False, bias: jax.Array | None = None,
                heads_first: tuple[int, int] | None = None, activation: Any = None,
                activation_of: jax.Array | None = None, params: tuple = ()) -> Any:
    """``x (M, K) . w (K, N)`` into ``out_dtype``: ``x`` (16 or 32 bits) quantized per row in the
    kernel, ``q_w`` the weight in int8 per column and ``s_w`` its ``(1, N)`` float32 scales
    (:func:`.int8_quantize.quantized_along` over ``K``); needs :func:`rows_blocks`.
    ``weight_rows``: ``q_w`` given as ``(N, K)``, its rows contracted (``x . q_wᵀ``): the input's
    gradient ``g . wᵀ`` reads the weight in the layout it is stored in, where a transposed copy
    would cost XLA a pass over the float32 master. ``bias``: a ``(1, N)`` row added to the result in
    float32 before its one rounding to ``out_dtype`` (a projection's bias: no pass of its own after the
    kernel, where XLA would fuse it into the layout copy that follows, at vector cost).
    ``heads_first``: ``(length, heads)``, the result written as ``(M / length, heads, length, N / heads)``
    (needs :func:`heads_blocks`): a query, key or value as the attention kernel reads it, where the
    rows' layout takes XLA copies to lay it out so (the head size under 128 columns of a tile).
    A 4-D ``x`` is heads-first, ``(M / length, heads, length, K / heads)`` (an attention's output or a
    query's gradient as the attention kernel writes it), its heads' columns side by side.
    ``activation`` (:class:`.int8_activation.Activation`, rows' layouts only): applied to ``x``'s blocks
    in float32 before they are quantized; with ``activation_of`` (``(M, N)``, what the activation was
    applied to), the result is multiplied by its derivative there instead (the input gradient of a
    product that applied it: ``h``'s gradient). A row-wise activation (a norm: :mod:`.int8_norm`) reads
    its ``params`` (``(1, K)``, or ``(1, N)`` for the derivative, which then needs the whole row in one
    column block, :func:`prologue_rows`) and is applied to whole rows; through its derivative the
    result is ``(h's gradient, (M / bm, 1, N) float32 partial sums of each param's)``."""
    heads_in = x.ndim == 4
    (m, k), n = as_matrix(x.shape), q_w.shape[0 if weight_rows else 1]
    length = x.shape[2] if heads_in else m
    bm, bn = rows_blocks(m, k, n, prologue_rows(x.dtype.itemsize, activation if activation_of is None else None))
    heads = 0
    if heads_first:
        length = heads_first[0]
        bm, heads = heads_blocks(m, k, n, length, heads_first[1], x.dtype.itemsize)
        bn = heads * (n // heads_first[1])
    elif heads_in:
        bm = _token_block(length, bm)
    per = length // bm  # a sequence's row blocks
    in_sequence = lambda i: (jax.lax.div(i, per), jax.lax.rem(i, per))  # noqa: E731  (sequence, its row block)
    x_spec = pl.BlockSpec((bm, k), lambda i, j: (i, 0))
    if heads_in:
        x_spec = pl.BlockSpec((1, x.shape[1], bm, x.shape[3]), lambda i, j: (in_sequence(i)[0], 0, in_sequence(i)[1], 0))
    out_spec, out_shape = pl.BlockSpec((bm, bn), lambda i, j: (i, j)), (m, n)
    if heads_first:
        count_out = heads_first[1]
        out_spec = pl.BlockSpec((1, heads, bm, n // count_out),
                                lambda i, j: (in_sequence(i)[0], j, in_sequence(i)[1], 0))
        out_shape = (m // length, count_out, length, n // count_out)
    out_bytes = np.dtype(out_dtype).itemsize
    of = [] if activation_of is None else [activation_of]
    prologue = activation if activation is not None and not of else None
    through = activation is not None and bool(of) and bool(params)  # the params' gradients made too
    if params and of and bn != n:
        raise ValueError(f"rows_matmul: a row-wise activation's derivative needs whole rows of {n} in a block, "
                         f"not {bn}")
    cost = pl.CostEstimate(flops=2 * m * k * n, transcendentals=0 if activation is None else
                           activation.transcendentals * (m * n * 2 if of else m * k * 2),
                           bytes_accessed=m * k * x.dtype.itemsize + (1 if bn == n else m // bm) * (k * n + 4 * n)
                           + m * n * out_bytes + (0 if bias is None else n * bias.dtype.itemsize)
                           + sum(a.size * a.dtype.itemsize for a in of))
    weight = (pl.BlockSpec((bn, k), lambda i, j: (j, 0)) if weight_rows
              else pl.BlockSpec((k, bn), lambda i, j: (0, j)))
    row = pl.BlockSpec((1, bn), lambda i, j: (0, j))
    whole = pl.BlockSpec((1, n if of else k), lambda i, j: (0, 0))  # a param, all its columns
    params = [p.reshape(1, p.size) for p in params]
    ins = [x_spec, weight, row] + ([] if bias is None else [row]) + [out_spec for _ in of] + [whole for _ in params]
    partial = (pl.BlockSpec((1, 1, n), lambda i, j: (i, 0, 0)), ((m // bm, 1, n), F32))  # a param's, per row block
    outs = [(out_spec, (out_shape, out_dtype))] + [partial for _ in params if through]
    kernel = functools.partial(_rows_kernel, weight_rows=weight_rows, bias=bias is not None, heads=heads,
                               prologue=prologue, epilogue=activation if of else None, params=len(params))
    made = _call(kernel, ROWS, (m // bm, _cdiv(n, bn)), ins, [spec for spec, _ in outs], [out for _, out in outs],
                 _scratch((bm, k), INT8, (bm, 1), F32, interpret), ("parallel", "arbitrary"),
                 cost, interpret, x, q_w, s_w, *([] if bias is None else [bias.reshape(1, n)]), *of, *params)
    return (made[0], tuple(made[1:])) if through else made[0]


def prologue_rows(itemsize: int, activation: Any = None) -> int:
    """The bytes an element of the row kernel's input takes in its block (what :func:`rows_blocks` sizes
    the block of rows by): its own, or, for a row-wise activation applied to whole rows in float32, room
    for its float32 values and their temporaries."""
    return 8 if activation is not None and activation.row_wise else itemsize


def _side_by_side(ref: Any) -> jax.Array:
    """A block as (rows, columns): a heads-first one's heads side by side."""
    return ref[...] if len(ref.shape) == 2 else jnp.concatenate([ref[0, h] for h in range(ref.shape[1])], axis=1)


def _tiles_kernel(x_ref, g_ref, *refs, steps: int, sums: bool, prologue: Any, params: int):
    p_refs, (o_ref, *refs) = refs[:params], refs[params:]  # p: the activation's params, (1, bk) each
    sums_ref, acc_ref = refs if sums else (None, refs[0])
    t = pl.program_id(2)

    @pl.when(t == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        if sums:
            sums_ref[...] = jnp.zeros_like(sums_ref)

    x = _side_by_side(x_ref).astype(F32)
    x = x if prologue is None else prologue(x, *[p[...].astype(F32) for p in p_refs])
    x_t = x.T  # (bk, bm): a column of x a row, quantized over its bm tokens
    g = _side_by_side(g_ref)
    q_x, s_x = _scaled(x_t, axis=1)
    q_g, s_g = _scaled(g, axis=0)  # (bm, bn): per column over the bm tokens
    acc = jnp.dot(q_x, q_g, preferred_element_type=INT32)
    acc_ref[...] += acc.astype(F32) * (s_x * s_g)
    if sums:  # every row block of the result sums g's columns again: the same values, written each time
        sums_ref[...] += jnp.sum(g.astype(F32), axis=0, keepdims=True)

    @pl.when(t == steps - 1)  # the grid's last token block (static: see _row_tiles_kernel)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def tiles_matmul(x: jax.Array, g: jax.Array, out_dtype: Any, interpret: bool = False, g_sums: bool = False,
                 activation: Any = None, params: tuple = ()) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``xᵀ (K, M) . g (M, N)`` into ``out_dtype``, contracting the ``M`` tokens in blocks: each block's
    ``x`` and ``g`` quantized per column over its tokens (1 x bm tiles), the int32 products scaled and
    summed in float32; needs :func:`tiles_blocks`. A 4-D operand is heads-first, ``(M / length, heads,
    length, columns / heads)`` (an attention's output, a query's gradient, as the attention kernel
    writes them), its heads' columns side by side. ``g_sums``: also ``g``'s column sums, ``(1, N)`` in
    float32 (a bias's gradient: the blocks of ``g`` the product reads anyway, where XLA would read ``g``
    again in a reduction of its own, across a heads-first layout's tiles). ``activation``
    (:class:`.int8_activation.Activation`): applied to ``x``'s blocks in float32 before they are quantized;
    a row-wise one (a norm, reading its ``(1, K)`` ``params``) to tiles of whole rows (``whole_rows``)."""
    (m, k), (_, n) = (as_matrix(a.shape) for a in (x, g))
    length = next((a.shape[2] for a in (x, g) if a.ndim == 4), 0)
    heads = [a.shape[1] if a.ndim == 4 else 0 for a in (x, g)]
    whole_rows = activation is not None and activation.row_wise
    bm, bk, bn = tiles_blocks(m, k, n, x.dtype.itemsize, g.dtype.itemsize, length, *heads, whole_rows=whole_rows)
    cost = pl.CostEstimate(flops=2 * m * k * n,
                           transcendentals=0 if activation is None else activation.transcendentals * m * k * _cdiv(n, bn),
                           bytes_accessed=_cdiv(n, bn) * m * k * x.dtype.itemsize + (k // bk) * m * n * g.dtype.itemsize
                           + k * n * np.dtype(out_dtype).itemsize + (4 * n if g_sums else 0))
    per = length // bm if length else 0

    def spec(a: jax.Array, block: int, column: Callable) -> Any:  # a token block's columns, heads-first or not
        if a.ndim == 2:
            return pl.BlockSpec((bm, block), lambda i, j, t: (t, column(i, j)))
        width = a.shape[3]
        return pl.BlockSpec((1, block // width, bm, width),
                            lambda i, j, t: (jax.lax.div(t, per), column(i, j), jax.lax.rem(t, per), 0))

    params = [p.reshape(1, p.size) for p in params]
    ins = [spec(x, bk, lambda i, j: i), spec(g, bn, lambda i, j: j)] + [
        pl.BlockSpec((1, bk), lambda i, j, t: (0, i)) for _ in params]
    outs = [(pl.BlockSpec((bk, bn), lambda i, j, t: (i, j)), ((k, n), out_dtype))]
    if g_sums:
        outs.append((pl.BlockSpec((1, bn), lambda i, j, t: (0, j)), ((1, n), F32)))
    kernel = functools.partial(_tiles_kernel, steps=m // bm, sums=g_sums, prologue=activation, params=len(params))
    made = _call(kernel, TILES, (k // bk, _cdiv(n, bn), m // bm),
                 ins, [spec for spec, _ in outs], [out for _, out in outs], _scratch((bk, bn), F32, None, None, interpret),
                 _REDUCING, cost, interpret, x, g, *params)
    return tuple(made) if g_sums else made[0]


def _row_tiles_kernel(x_ref, qw_ref, sw_ref, o_ref, acc_ref, *, steps: int):
    t = pl.program_id(2)

    @pl.when(t == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    q_x, s_x = _scaled(x_ref[...], axis=1)  # (bm, bc): per row within the tile
    acc = jax.lax.dot_general(q_x, qw_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=INT32)
    acc_ref[...] += acc.astype(F32) * s_x

    # The last tile, as a number each call's kernel holds: with `pl.num_programs(2)`, jax 0.11's
    # interpreter reused the first call's grid for a later call of another size, never wrote the
    # output and returned NaN (tests/test_int8_pallas.py, two sizes in one process).
    @pl.when(t == steps - 1)
    def _():
        o_ref[...] = (acc_ref[...] * sw_ref[...]).astype(o_ref.dtype)


def row_tiles_matmul(x: jax.Array, q_w: jax.Array, s_w: jax.Array, out_dtype: Any, interpret: bool = False
                     ) -> jax.Array:
    """``x (M, C) . wᵀ`` (``w (N, C)``) into ``out_dtype``, contracting ``C`` in tiles: each tile of ``x``'s
    rows quantized in the kernel with its own scales, the int32 products scaled by them and summed in
    float32, then by ``w``'s: ``q_w`` in int8 per row of ``w`` and ``s_w`` its ``(1, N)`` scales
    (:func:`.int8_quantize.quantized_along` over ``C``, by XLA). For a ``C`` too wide for a whole row
    in one block (a language model head's input gradient contracts the vocabulary); needs
    :func:`row_tiles_blocks`."""
    (m, c), n = x.shape, q_w.shape[0]
    bm, bc, bn = row_tiles_blocks(m, c, n)
    cost = pl.CostEstimate(flops=2 * m * c * n, transcendentals=0,
                           bytes_accessed=_cdiv(n, bn) * m * c * x.dtype.itemsize + m // bm * c * n + 4 * n
                           + m * n * np.dtype(out_dtype).itemsize)
    ins = [pl.BlockSpec((bm, bc), lambda i, j, t: (i, t)), pl.BlockSpec((bn, bc), lambda i, j, t: (j, t)),
           pl.BlockSpec((1, bn), lambda i, j, t: (0, j))]
    return _call(functools.partial(_row_tiles_kernel, steps=c // bc), ROW_TILES, (m // bm, _cdiv(n, bn), c // bc), ins,
                 pl.BlockSpec((bm, bn), lambda i, j, t: (i, j)), ((m, n), out_dtype),
                 _scratch((bm, bn), F32, None, None, interpret), _REDUCING, cost, interpret, x, q_w, s_w)


def _call(kernel: Any, name: str, grid: tuple, in_specs: list, out_spec: Any, out: tuple | list, scratch: list,
          semantics: tuple[str, ...], cost: Any, interpret: bool, *args: jax.Array) -> Any:
    """``pallas_call`` of ``kernel`` on ``args`` (result: ``out``, its (shape, dtype); a list of them: a
    list of results, as ``out_spec`` is a list) in :data:`SCOPE`."""
    shapes = [jax.ShapeDtypeStruct(*o) for o in out] if isinstance(out, list) else jax.ShapeDtypeStruct(*out)
    call = pl.pallas_call(kernel, name=name, grid=grid, in_specs=in_specs, out_specs=out_spec,
                          out_shape=shapes, scratch_shapes=scratch,
                          compiler_params=None if interpret else _compiler_params(semantics),
                          cost_estimate=cost, interpret=interpret)
    with jax.named_scope(SCOPE):
        return call(*args)


def as_matrix(shape: tuple) -> tuple[int, int]:
    """(rows, columns) of an operand: as it is, or heads-first ``(sequences, heads, length, head size)``."""
    return (shape[0] * shape[2], shape[1] * shape[3]) if len(shape) == 4 else tuple(shape)


def _scratch(shape: tuple, dtype: Any, shape2: tuple | None, dtype2: Any, interpret: bool) -> list:
    """VMEM scratch buffers of these shapes and dtypes (the second: when given)."""
    from jax.experimental.pallas import tpu as pltpu

    return [pltpu.VMEM(s, d) for s, d in [(shape, dtype), (shape2, dtype2)] if s is not None]

