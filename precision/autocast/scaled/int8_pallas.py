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
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from precision.autocast.scaled.int8_quantize import F32, INT8, INT32, QMAX

__all__ = ["SCOPE", "ROWS", "TILES", "ROW_TILES", "module_path", "rows_blocks", "heads_blocks", "tiles_blocks",
           "row_tiles_blocks", "rows_matmul", "tiles_matmul", "row_tiles_matmul", "as_matrix"]

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
_BLOCK_BYTES = 4 * 2**20  # at most this much of one 16-bit operand per block
_ROWS_BYTES = 16 * 2**20  # the row kernel's block of rows (quantized a chunk of columns at a time)
_CHUNK = 2048
_REDUCING = ("parallel", "parallel", "arbitrary")  # a grid whose last axis sums into the output block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_block(m: int, largest: int) -> int:
    """The largest power of two from ``largest`` down to 128 that divides ``m`` (0: none): the
    blocks a product contracts or quantizes along must divide it exactly."""
    size = 1 << (max(largest, 1).bit_length() - 1)
    while size >= 128:
        if m % size == 0:
            return size
        size //= 2
    return 0


def rows_blocks(m: int, k: int, n: int, itemsize: int = 2) -> tuple[int, int] | None:
    """(bm, bn) of :func:`rows_matmul` for an ``(m, k) x (k, n)`` product, or None where it cannot take
    it: ``m`` and ``k`` multiples of 128, a block of rows within :data:`_ROWS_BYTES`: at least 512 of
    them (the weight is read once per row block) unless the whole int8 weight is one block (then read
    once, kept in VMEM). Row blocks up to 2048; columns in blocks of 512 (the last one partial where 512
    does not divide ``n``: each output column depends on its own weight column alone)."""
    if k % 128 or n < 128:
        return None
    rows = min(2048, _ROWS_BYTES // (k * itemsize))
    if k * n <= 2 * _BLOCK_BYTES:  # the whole int8 weight one block
        bm = _token_block(m, min(rows, 4 * _BLOCK_BYTES // (n * 12)))
        return (bm, n) if bm else None
    bm = _token_block(m, rows) if rows >= 512 else 0
    return (bm, next((b for b in (512, 256) if n % b == 0), 512 if n >= 512 else n // 128 * 128)) if bm else None


def heads_blocks(m: int, k: int, n: int, length: int, heads: int, itemsize: int = 2) -> tuple[int, int] | None:
    """(bm, heads per block) of :func:`rows_matmul` writing its result heads-first: ``m`` rows of
    sequences of ``length``, ``n`` columns of ``heads`` heads; or None where it cannot: a row block
    (:func:`rows_blocks`) within one sequence, a column block of whole heads (all of them, or a multiple
    of 128 columns) no wider than the row kernel's."""
    blocks = rows_blocks(m, k, n, itemsize)
    if blocks is None or n % heads or length % 128 or m % length:
        return None
    width = n // heads
    bm = _token_block(length, blocks[0])
    fits = [h for h in range(heads, 0, -1) if heads % h == 0 and h * width <= blocks[1]
            and (h == heads or h * width % 128 == 0)]
    return (bm, fits[0]) if bm and fits else None


def row_tiles_blocks(m: int, c: int, n: int) -> tuple[int, int, int] | None:
    """(bm, bc, bn) of :func:`row_tiles_matmul` for ``(m, c) x (c, n)`` contracting ``c`` in tiles of
    ``bc`` (the largest multiple of 128 up to 2048 dividing it), or None where none divides it."""
    bc = next((b for b in range(2048, 127, -128) if c % b == 0), 0)
    bn = n if n <= 4096 else 512
    bm = _token_block(m, min(2048, 2 * _BLOCK_BYTES // (bn * 4)))
    return (bm, bc, bn) if bc and bm and n >= 128 else None


def tiles_blocks(m: int, k: int, n: int, x_itemsize: int = 2, g_itemsize: int = 2, length: int = 0, x_heads: int = 0,
                 g_heads: int = 0) -> tuple[int, int, int] | None:
    """(bm, bk, bn) of :func:`tiles_matmul` for ``(m, k)ᵀ x (m, n)``, or None where it cannot take it:
    tiles of 256 tokens (or the largest power of two from 128 dividing ``m``), and the (bk, bn) output
    block that moves the fewest bytes (``x`` read once per column block, ``g`` once per row block)
    with its float32 accumulator within 4 x :data:`_BLOCK_BYTES`; ``bk`` divides ``k``, the last
    column block may be partial. ``x_heads``, ``g_heads``: that many heads of an operand given
    heads-first in sequences of ``length``: token tiles within one sequence, blocks of whole heads."""
    bm = _token_block(math.gcd(m, length) if length else m, 256)
    if not bm or k % 128 or n < 128 or (x_heads and k % x_heads) or (g_heads and n % g_heads):
        return None
    ks = [b for b in range(128, k + 1, 128) if k % b == 0 and (not x_heads or b % (k // x_heads) == 0)]
    ns = [b for b in (*range(128, 4097, 128), n) if b <= n and (not g_heads or b % (n // g_heads) == 0)]
    fits = [(_cdiv(n, bn) * k * x_itemsize + k // bk * n * g_itemsize, -bn, bk, bn) for bk in ks for bn in ns
            if bk * bn * 4 <= 4 * _BLOCK_BYTES and (not g_heads or g_heads % (bn // (n // g_heads)) == 0)]
    if not fits:
        return None
    _, _, bk, bn = min(fits)
    return bm, bk, bn


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


def _row_pieces(x_ref: Any) -> list[tuple[Callable[[], jax.Array], int, int]]:
    """A row block's columns in pieces (each read when called, its first and last column): chunks of a
    rows' block (float32 copies of a chunk at a time), or each head of a heads-first one."""
    if len(x_ref.shape) == 4:  # (1, heads, rows, head size)
        width = x_ref.shape[3]
        return [(lambda h=h: x_ref[0, h], h * width, (h + 1) * width) for h in range(x_ref.shape[1])]
    k = x_ref.shape[1]
    return [(lambda a=a, b=b: x_ref[:, a:b], a, b) for a, b in ((c, min(c + _CHUNK, k)) for c in range(0, k, _CHUNK))]


def _rows_kernel(x_ref, qw_ref, sw_ref, *refs, weight_rows: bool, bias: bool, heads: int = 0):
    b_ref, (o_ref, qx_ref, sx_ref) = (refs[0], refs[1:]) if bias else (None, refs)

    @pl.when(pl.program_id(1) == 0)  # the row block quantized once, reused by every column block
    def _():
        pieces = _row_pieces(x_ref)
        amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(read()), axis=1, keepdims=True) for read, _, _ in pieces])
        scale = _scale(amax)
        for read, a, b in pieces:
            qx_ref[:, a:b] = _quantize(read(), scale)
        sx_ref[...] = scale

    contract = 1 if weight_rows else 0  # the weight block's axis the product contracts
    acc = jax.lax.dot_general(qx_ref[...], qw_ref[...], (((1,), (contract,)), ((), ())), preferred_element_type=INT32)
    y = acc.astype(F32) * (sx_ref[...] * sw_ref[...])
    y = (y + b_ref[...].astype(F32) if bias else y).astype(o_ref.dtype)
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
                heads_first: tuple[int, int] | None = None) -> jax.Array:
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
    query's gradient as the attention kernel writes it), its heads' columns side by side."""
    heads_in = x.ndim == 4
    (m, k), n = as_matrix(x.shape), q_w.shape[0 if weight_rows else 1]
    length = x.shape[2] if heads_in else m
    bm, bn = rows_blocks(m, k, n, x.dtype.itemsize)
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
    cost = pl.CostEstimate(flops=2 * m * k * n, transcendentals=0,
                           bytes_accessed=m * k * x.dtype.itemsize + (1 if bn == n else m // bm) * (k * n + 4 * n)
                           + m * n * out_bytes + (0 if bias is None else n * bias.dtype.itemsize))
    weight = (pl.BlockSpec((bn, k), lambda i, j: (j, 0)) if weight_rows
              else pl.BlockSpec((k, bn), lambda i, j: (0, j)))
    row = pl.BlockSpec((1, bn), lambda i, j: (0, j))
    ins = [x_spec, weight, row] + ([] if bias is None else [row])
    kernel = functools.partial(_rows_kernel, weight_rows=weight_rows, bias=bias is not None, heads=heads)
    return _call(kernel, ROWS, (m // bm, _cdiv(n, bn)), ins, out_spec,
                 (out_shape, out_dtype), _scratch((bm, k), INT8, (bm, 1), F32, interpret), ("parallel", "arbitrary"),
                 cost, interpret, x, q_w, s_w, *([] if bias is None else [bias.reshape(1, n)]))


def _side_by_side(ref: Any) -> jax.Array:
    """A block as (rows, columns): a heads-first one's heads side by side."""
    return ref[...] if len(ref.shape) == 2 else jnp.concatenate([ref[0, h] for h in range(ref.shape[1])], axis=1)


def _tiles_kernel(x_ref, g_ref, o_ref, acc_ref, *, steps: int):
    t = pl.program_id(2)

    @pl.when(t == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x_t = _side_by_side(x_ref).astype(F32).T  # (bk, bm): a column of x is a row here, quantized over its bm tokens
    q_x, s_x = _scaled(x_t, axis=1)
    q_g, s_g = _scaled(_side_by_side(g_ref), axis=0)  # (bm, bn): per column over the bm tokens
    acc = jnp.dot(q_x, q_g, preferred_element_type=INT32)
    acc_ref[...] += acc.astype(F32) * (s_x * s_g)

    @pl.when(t == steps - 1)  # the grid's last token block (static: see _row_tiles_kernel)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def tiles_matmul(x: jax.Array, g: jax.Array, out_dtype: Any, interpret: bool = False) -> jax.Array:
    """``xᵀ (K, M) . g (M, N)`` into ``out_dtype``, contracting the ``M`` tokens in blocks: each block's
    ``x`` and ``g`` quantized per column over its tokens (1 x bm tiles), the int32 products scaled and
    summed in float32; needs :func:`tiles_blocks`. A 4-D operand is heads-first, ``(M / length, heads,
    length, columns / heads)`` (an attention's output, a query's gradient, as the attention kernel
    writes them), its heads' columns side by side."""
    (m, k), (_, n) = (as_matrix(a.shape) for a in (x, g))
    length = next((a.shape[2] for a in (x, g) if a.ndim == 4), 0)
    heads = [a.shape[1] if a.ndim == 4 else 0 for a in (x, g)]
    bm, bk, bn = tiles_blocks(m, k, n, x.dtype.itemsize, g.dtype.itemsize, length, *heads)
    cost = pl.CostEstimate(flops=2 * m * k * n, transcendentals=0,
                           bytes_accessed=_cdiv(n, bn) * m * k * x.dtype.itemsize + (k // bk) * m * n * g.dtype.itemsize
                           + k * n * np.dtype(out_dtype).itemsize)
    per = length // bm if length else 0

    def spec(a: jax.Array, block: int, column: Callable) -> Any:  # a token block's columns, heads-first or not
        if a.ndim == 2:
            return pl.BlockSpec((bm, block), lambda i, j, t: (t, column(i, j)))
        width = a.shape[3]
        return pl.BlockSpec((1, block // width, bm, width),
                            lambda i, j, t: (jax.lax.div(t, per), column(i, j), jax.lax.rem(t, per), 0))

    ins = [spec(x, bk, lambda i, j: i), spec(g, bn, lambda i, j: j)]
    return _call(functools.partial(_tiles_kernel, steps=m // bm), TILES, (k // bk, _cdiv(n, bn), m // bm), ins,
                 pl.BlockSpec((bk, bn), lambda i, j, t: (i, j)), ((k, n), out_dtype),
                 _scratch((bk, bn), F32, None, None, interpret), _REDUCING, cost, interpret, x, g)


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


def _call(kernel: Any, name: str, grid: tuple, in_specs: list, out_spec: Any, out: tuple, scratch: list,
          semantics: tuple[str, ...], cost: Any, interpret: bool, *args: jax.Array) -> jax.Array:
    """``pallas_call`` of ``kernel`` on ``args`` (result: ``out``, its (shape, dtype)) in :data:`SCOPE`."""
    call = pl.pallas_call(kernel, name=name, grid=grid, in_specs=in_specs, out_specs=out_spec,
                          out_shape=jax.ShapeDtypeStruct(*out), scratch_shapes=scratch,
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

    shapes = [(shape, dtype)] + ([(shape2, dtype2)] if shape2 is not None else [])
    return [pltpu.VMEM(s, d) for s, d in shapes]

