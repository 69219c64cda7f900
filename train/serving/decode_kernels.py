"""The kernels of a fused decode step: one token at batch ``B``, a layer in five launches.

At batch 1 a decode step reads every weight once for two FLOPs a weight: its time is the
weights' bytes over the memory bandwidth, plus a launch per kernel. XLA launches about
twenty kernels a Llama layer (the norm, its cast, each projection, the rotary embedding,
the cache's two writes and its index, the mask's cast, the residual adds), and at 32 layers
those launches cost more than half of what the bytes do on an H100
(``benchmarks/results/serving-llama3_8b.md``). These Pallas kernels do a layer in five:

- :func:`norm_qkv`: the RMS norm, the query, key and value projections, the rotary embedding;
- :func:`attend`: attention of each query head over the cache and the new key, which it
  writes into the cache in place;
- :func:`gemv_add`: a projection plus the residual (the attention's output; the MLP's down);
- :func:`norm_swiglu`: the RMS norm, the gate and up projections, ``silu(gate) * up``;
- and :func:`norm_gemv` for the head.

Each is a matrix-vector product streaming its weight in tiles of rows (outputs) by columns,
accumulating in float32; the norm is recomputed by every program from the ``(B, d)`` row
(a few KB) rather than launched on its own. On a GPU they are Triton kernels (Pallas'
Triton backend); elsewhere the same kernels run interpreted, which is how the tests check
them on a CPU (:func:`jax.lax.platform_dependent` picks). Every block size is a power of
two: :func:`fits` says whether a model's widths allow one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from precision.channel_weights import is_channel_int8

__all__ = ["fits", "norm_qkv", "attend", "gemv_add", "norm_swiglu", "norm_gemv", "BLOCK_K", "BLOCK_N",
           "BLOCK_POSITIONS"]

#: A weight's rows (outputs) a program owns, at most, and its contracted columns a loop iteration
#: streams, at least: fewer rows where that leaves fewer than :data:`PROGRAMS` programs (an H100 has
#: 132 SMs: a GEMV with 32 programs would stream on a quarter of them), longer tiles for fewer rows
#: (up to :data:`TILE` elements an iteration).
BLOCK_N, BLOCK_K, PROGRAMS, TILE = 128, 128, 256, 8192
#: Cache positions one iteration of the attention reads.
BLOCK_POSITIONS = 64
_F32 = jnp.float32


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fits(batch: int, hidden: int, head_dim: int, *widths: int) -> bool:
    """Whether these kernels take a model: the batch and head width powers of two, and every
    contracted and produced width a multiple of 16 (its block: the largest power of two up to 128
    dividing it)."""
    return (_power_of_two(batch) and _power_of_two(head_dim) and head_dim >= 16
            and all(_block(n, BLOCK_K) >= 16 for n in (hidden, *widths)))


def _call(kernel, out_shape, grid, in_specs, out_specs, args, aliases=None):
    """``kernel`` as a Triton kernel on a GPU, interpreted elsewhere (the same program)."""
    def run(interpret: bool):
        extra = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=4, num_stages=3)}
        return lambda *a: pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                                         out_specs=out_specs, input_output_aliases=aliases or {},
                                         interpret=interpret, **extra)(*a)

    return jax.lax.platform_dependent(*args, cuda=run(False), default=run(True))


def _whole(shape):
    """A block that is the whole array, for every program."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _block(n: int, block: int) -> int:
    """The largest power of two up to ``block`` that divides ``n``."""
    while n % block:
        block //= 2
    return block


def _rstd(x_ref, eps: float):
    x = x_ref[...].astype(_F32)
    return jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class _Weight:
    """A weight stored ``(n, k)`` (its contracted axis last: :mod:`train.serving.layout`), as
    an array or int8 codes with a float32 scale a row (:class:`precision.ChannelInt8`), read
    in ``dtype`` as the model reads it."""

    def __init__(self, w):
        self.codes, self.scales = (w.codes, w.scales) if is_channel_int8(w) else (w, None)
        self.dtype = jnp.dtype(w.dtype)
        self.n, self.k = self.codes.shape

    @property
    def operands(self) -> tuple:
        return (self.codes,) if self.scales is None else (self.codes, self.scales)

    def take(self, refs: list):
        """The kernel's view of this weight: its refs, taken off the front of ``refs``."""
        return _WeightRefs(refs.pop(0), refs.pop(0) if self.scales is not None else None, self.dtype)


class _WeightRefs:
    def __init__(self, codes, scales, dtype):
        self.codes, self.scales, self.dtype = codes, scales, dtype

    def tile(self, rows, cols):
        """Rows ``rows`` (outputs) by columns ``cols`` (contracted) in float32, rounded as read."""
        w = self.codes[rows, cols].astype(_F32)
        if self.scales is not None:
            w = w * self.scales[rows, :].astype(_F32)
        return w.astype(self.dtype).astype(_F32)


def _columns(n: int) -> int:
    """The rows of an ``(n, k)`` weight one program owns (:data:`BLOCK_N`, :data:`PROGRAMS`)."""
    bn = BLOCK_N
    while bn > 16 and n // bn < PROGRAMS:
        bn //= 2
    return _block(n, bn)


def _normalized(x_ref, norm_ref, rstd, dtype):
    """``x(cols)``: those columns of the normed rows, rounded to ``dtype`` as the model's norm
    hands them to its projection."""
    def chunk(cols):
        x = x_ref[:, cols].astype(_F32) * rstd
        return (x.astype(dtype).astype(_F32) * norm_ref[cols].astype(_F32)[None, :]).astype(dtype).astype(_F32)

    return chunk


def _plain(x_ref, dtype):
    """``x(cols)``: those columns of the rows, rounded to ``dtype``."""
    return lambda cols: x_ref[:, cols].astype(dtype).astype(_F32)


def _gemv(rows, w, first, width):
    """``rows @ w[first:first + width].T`` in float32 (``w`` a :class:`_WeightRefs`), ``rows(cols)``
    giving those columns of the contracted axis."""
    k = w.codes.shape[1]
    bk = _block(k, max(BLOCK_K, TILE // width))

    def body(i, acc):
        cols = pl.ds(i * bk, bk)
        tile = w.tile(pl.ds(first, width), cols)  # (width, bk)
        return acc + jnp.sum(rows(cols)[:, None, :] * tile[None, :, :], axis=2)

    return jax.lax.fori_loop(0, k // bk, body, jnp.zeros((rows(pl.ds(0, bk)).shape[0], width), _F32))


def _specs(*arrays):
    return [_whole(a.shape) for a in arrays]


def norm_gemv(x, norm, w, eps: float):
    """``rms_norm(x) @ w.T`` in float32: ``x`` ``(B, d)``, ``w`` ``(n, d)`` (the head)."""
    w = _Weight(w)
    b, bn = x.shape[0], _columns(w.n)

    def kernel(x_ref, norm_ref, *refs):
        refs = list(refs)
        weight, o_ref = w.take(refs), refs[0]
        rows = _normalized(x_ref, norm_ref, _rstd(x_ref, eps), w.dtype)
        o_ref[...] = _gemv(rows, weight, pl.program_id(0) * bn, bn)

    args = (x, norm, *w.operands)
    return _call(kernel, jax.ShapeDtypeStruct((b, w.n), _F32), (w.n // bn,), _specs(*args),
                 pl.BlockSpec((b, bn), lambda j: (0, j)), args)


def gemv_add(a, w, residual):
    """``residual + a @ w.T`` in float32: ``a`` ``(B, k)`` (rounded to the weight's dtype as it
    is read), ``w`` ``(d, k)``, ``residual`` ``(B, d)``."""
    w = _Weight(w)
    b, bn = residual.shape[0], _columns(w.n)

    def kernel(a_ref, r_ref, *refs):
        refs = list(refs)
        weight, o_ref = w.take(refs), refs[0]
        o_ref[...] = r_ref[...].astype(_F32) + _gemv(_plain(a_ref, w.dtype), weight, pl.program_id(0) * bn, bn)

    args = (a, residual, *w.operands)
    specs = [_whole(a.shape), pl.BlockSpec((b, bn), lambda j: (0, j)), *_specs(*w.operands)]
    return _call(kernel, jax.ShapeDtypeStruct((b, w.n), _F32), (w.n // bn,), specs,
                 pl.BlockSpec((b, bn), lambda j: (0, j)), args)


def norm_swiglu(x, norm, gate, up, eps: float):
    """``silu(rms_norm(x) @ gate.T) * (rms_norm(x) @ up.T)``, ``(B, hidden)``, rounded to the
    weights' dtype as the model's MLP computes it."""
    gate, up = _Weight(gate), _Weight(up)
    b, bn = x.shape[0], _columns(gate.n)

    def kernel(x_ref, norm_ref, *refs):
        refs = list(refs)
        g_w, u_w, o_ref = gate.take(refs), up.take(refs), refs[0]
        rows = _normalized(x_ref, norm_ref, _rstd(x_ref, eps), gate.dtype)
        first = pl.program_id(0) * bn
        g = _gemv(rows, g_w, first, bn).astype(gate.dtype).astype(_F32)
        u = _gemv(rows, u_w, first, bn).astype(up.dtype).astype(_F32)
        o_ref[...] = ((g * jax.nn.sigmoid(g)).astype(gate.dtype).astype(_F32) * u).astype(o_ref.dtype)

    args = (x, norm, *gate.operands, *up.operands)
    return _call(kernel, jax.ShapeDtypeStruct((b, gate.n), gate.dtype), (gate.n // bn,), _specs(*args),
                 pl.BlockSpec((b, bn), lambda j: (0, j)), args)


def norm_qkv(x, norm, wq, wk, wv, sincos, eps: float):
    """``(B, (Hq + 2 Hkv) * hd)`` float32: the normed rows' queries and keys, rotated (the
    rotary embedding at one position, ``sincos`` ``(hd,)``: its sines then its cosines, a half
    each; ``[x1, x2]`` becomes ``[x1 cos - x2 sin, x2 cos + x1 sin]``), then the values. The
    weights are ``(heads * hd, d)``. A program owns a part of a head: ``w`` columns of each of
    its halves (the pairs the rotation mixes), at least 16, up to 4 parts a head."""
    wq, wk, wv = _Weight(wq), _Weight(wk), _Weight(wv)
    b, hd = x.shape[0], sincos.shape[0]
    hq, hkv, half = wq.n // hd, wk.n // hd, hd // 2
    parts = max(1, min(4, half // 16))
    w = half // parts

    def kernel(x_ref, norm_ref, sincos_ref, *refs):
        refs = list(refs)
        q_w, k_w, v_w, o_ref = wq.take(refs), wk.take(refs), wv.take(refs), refs[0]
        rows = _normalized(x_ref, norm_ref, _rstd(x_ref, eps), wq.dtype)
        head, part = pl.program_id(0), pl.program_id(1)
        first = part * w

        def rotated(weight, h):
            lo = _gemv(rows, weight, h * hd + first, w).astype(weight.dtype).astype(_F32)
            hi = _gemv(rows, weight, h * hd + half + first, w).astype(weight.dtype).astype(_F32)
            s, c = sincos_ref[pl.ds(first, w)][None, :], sincos_ref[pl.ds(half + first, w)][None, :]
            o_ref[:, pl.ds(first, w)] = lo * c - hi * s
            o_ref[:, pl.ds(half + first, w)] = hi * c + lo * s

        @pl.when(head < hq)
        def _():
            rotated(q_w, head)

        @pl.when((head >= hq) & (head < hq + hkv))
        def _():
            rotated(k_w, head - hq)

        @pl.when(head >= hq + hkv)
        def _():
            value = _gemv(rows, v_w, (head - hq - hkv) * hd + 2 * first, 2 * w)
            o_ref[:, pl.ds(2 * first, 2 * w)] = value.astype(wv.dtype).astype(_F32)

    args = (x, norm, sincos, *wq.operands, *wk.operands, *wv.operands)
    return _call(kernel, jax.ShapeDtypeStruct((b, (hq + 2 * hkv) * hd), _F32), (hq + 2 * hkv, parts),
                 _specs(*args), pl.BlockSpec((b, hd), lambda h, p: (0, h)), args)


def attend(qkv, cached_key, cached_value, index, heads: int):
    """Each of ``heads`` query heads of ``qkv`` (:func:`norm_qkv`'s) attending over the cache's
    positions before ``index`` and the new key and value (grouped: query head ``h`` reads key
    head ``h // (heads / Hkv)``), softmax in float32; the new key and value written into the
    cache at ``index`` (in place: the caches are donated). Returns ``(B, heads * hd)`` float32
    and the two caches. The cache is ``(B, length, Hkv, hd)``, as Hugging Face's Flax models keep it."""
    b, length, hkv, hd = cached_key.shape
    group, bl = heads // hkv, _block(length, BLOCK_POSITIONS)
    scale = 1.0 / float(hd) ** 0.5

    def kernel(index_ref, q_ref, k_ref, v_ref, ck_ref, cv_ref, o_ref, ck_out, cv_out):
        row, head = pl.program_id(0), pl.program_id(1)
        kv, at = head // group, index_ref[0]
        q = q_ref[...].astype(_F32) * scale  # (1, hd)
        k_new, v_new = k_ref[...].astype(_F32), v_ref[...].astype(_F32)

        def body(j, carry):
            m, s, acc = carry
            where = pl.ds(j * bl, bl)
            keys = ck_ref[row, where, kv, :].astype(_F32)  # (bl, hd)
            scores = jnp.sum(keys * q, axis=1)
            scores = jnp.where(j * bl + jnp.arange(bl) < at, scores, -jnp.inf)
            top = jnp.maximum(m, jnp.max(scores))
            p = jnp.exp(scores - top)
            values = cv_ref[row, where, kv, :].astype(_F32)
            acc = acc * jnp.exp(m - top) + jnp.sum(p[:, None] * values, axis=0, keepdims=True)
            return top, s * jnp.exp(m - top) + jnp.sum(p), acc

        new = jnp.sum(k_new * q)
        m, s, acc = jax.lax.fori_loop(0, (at + bl - 1) // bl, body, (new, jnp.float32(1.0), v_new))
        o_ref[...] = acc / s

        @pl.when(head % group == 0)
        def _():
            ck_out[row, pl.ds(at, 1), kv, :] = k_new.astype(ck_out.dtype)  # ck_ref's buffer, aliased
            cv_out[row, pl.ds(at, 1), kv, :] = v_new.astype(cv_out.dtype)

    index = jnp.reshape(index, (1,)).astype(jnp.int32)
    specs = [_whole((1,)), pl.BlockSpec((1, hd), lambda r, h: (r, h)),
             pl.BlockSpec((1, hd), lambda r, h: (r, heads + h // group)),
             pl.BlockSpec((1, hd), lambda r, h: (r, heads + hkv + h // group)),
             _whole(cached_key.shape), _whole(cached_value.shape)]
    outs = (jax.ShapeDtypeStruct((b, heads * hd), _F32), jax.ShapeDtypeStruct(cached_key.shape, cached_key.dtype),
            jax.ShapeDtypeStruct(cached_value.shape, cached_value.dtype))
    out_specs = (pl.BlockSpec((1, hd), lambda r, h: (r, h)), _whole(cached_key.shape), _whole(cached_value.shape))
    return _call(kernel, outs, (b, heads), specs, out_specs, (index, qkv, qkv, qkv, cached_key, cached_value),
                 aliases={4: 1, 5: 2})

