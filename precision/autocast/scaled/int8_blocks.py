"""The blocks the int8 Pallas kernels (:mod:`.int8_pallas`) take a product in, or None where they cannot.

A kernel's grid walks its operands block by block through VMEM: a block of whole rows for
the row kernel (its quantization needs a row's every value), token tiles and output blocks
for the tiled ones. These functions pick the sizes: powers of two that divide the tokens
(a block never straddles a sequence where heads-first operands ask it), column blocks of
whole heads, and within VMEM with room for double buffering.
"""

from __future__ import annotations

import math

__all__ = ["rows_blocks", "heads_blocks", "row_tiles_blocks", "tiles_blocks"]

_BLOCK_BYTES = 4 * 2**20  # at most this much of one 16-bit operand per block
_ROWS_BYTES = 16 * 2**20  # the row kernel's block of rows (quantized a chunk of columns at a time)


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
    """(bm, bn) of :func:`.int8_pallas.rows_matmul` for an ``(m, k) x (k, n)`` product, or None where it cannot take
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
    """(bm, heads per block) of :func:`.int8_pallas.rows_matmul` writing its result heads-first: ``m`` rows of
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
    """(bm, bc, bn) of :func:`.int8_pallas.row_tiles_matmul` for ``(m, c) x (c, n)`` contracting ``c`` in tiles of
    ``bc`` (the largest multiple of 128 up to 2048 dividing it), or None where none divides it."""
    bc = next((b for b in range(2048, 127, -128) if c % b == 0), 0)
    bn = n if n <= 4096 else 512
    bm = _token_block(m, min(2048, 2 * _BLOCK_BYTES // (bn * 4)))
    return (bm, bc, bn) if bc and bm and n >= 128 else None


def tiles_blocks(m: int, k: int, n: int, x_itemsize: int = 2, g_itemsize: int = 2, length: int = 0, x_heads: int = 0,
                 g_heads: int = 0, whole_rows: bool = False) -> tuple[int, int, int] | None:
    """(bm, bk, bn) of :func:`.int8_pallas.tiles_matmul` for ``(m, k)ᵀ x (m, n)``, or None where it cannot take it:
    tiles of 256 tokens (or the largest power of two from 128 dividing ``m``), and the (bk, bn) output
    block that moves the fewest bytes (``x`` read once per column block, ``g`` once per row block)
    with its float32 accumulator within 4 x :data:`_BLOCK_BYTES`; ``bk`` divides ``k``, the last
    column block may be partial. ``x_heads``, ``g_heads``: that many heads of an operand given
    heads-first in sequences of ``length``: token tiles within one sequence, blocks of whole heads.
    ``whole_rows``: ``bk`` is ``k`` (a norm applied to ``x``'s tiles needs their whole rows)."""
    bm = _token_block(math.gcd(m, length) if length else m, 256)
    if not bm or k % 128 or n < 128 or (x_heads and k % x_heads) or (g_heads and n % g_heads):
        return None
    ks = [b for b in range(128, k + 1, 128) if k % b == 0 and (not x_heads or b % (k // x_heads) == 0)
          and (b == k or not whole_rows)]
    ns = [b for b in (*range(128, 4097, 128), n) if b <= n and (not g_heads or b % (n // g_heads) == 0)]
    fits = [(_cdiv(n, bn) * k * x_itemsize + k // bk * n * g_itemsize, -bn, bk, bn) for bk in ks for bn in ns
            if bk * bn * 4 <= 4 * _BLOCK_BYTES and (not g_heads or g_heads % (bn // (n // g_heads)) == 0)]
    if not fits:
        return None
    _, _, bk, bn = min(fits)
    return bm, bk, bn
