"""The matrix-vector kernels of a fused decode step: one token at batch ``B``.

At batch 1 a decode step reads every weight once for two FLOPs a weight: its time is the
weights' bytes over the memory bandwidth, plus a launch per kernel. XLA launches about
twenty kernels a Llama layer (the norm, its cast, each projection, the rotary embedding,
the cache's two writes and its index, the mask's cast, the residual adds) and sixteen a
GPT-2 layer, and those launches cost more than the bytes do on an H100
(``benchmarks/results/serving-*.md``). With these Pallas kernels and the attention's
(:mod:`train.serving.decode_attention`) a layer is five launches:

- :func:`norm_qkv`: an RMS norm, the query, key and value projections, the rotary embedding
  (Llama); :func:`norm_gemv` with a bias for a LayerNorm and one fused ``c_attn`` (GPT-2);
- the attention, which writes the new key and value into the cache in place;
- :func:`gemv_add`: a projection (and its bias) plus the residual: the attention's output
  projection, the MLP's down projection;
- :func:`norm_swiglu`: the norm, the gate and up projections, ``silu(gate) * up`` (Llama);
  :func:`norm_gemv` with a bias and GELU (GPT-2);
- and :func:`norm_gemv` for a Llama's head.

Each is a matrix-vector product streaming its weight in tiles of rows (outputs) by columns,
accumulating in float32; the norm (:class:`Norm`) is recomputed by every program from the
``(B, d)`` rows (a few KB) rather than launched on its own. A projection's result is rounded
to its weight's dtype, and its bias added, as the model's layer computes it. On a GPU they
are Triton kernels (Pallas' Triton backend); elsewhere the same kernels run interpreted,
which is how the tests check them on a CPU (:func:`jax.lax.platform_dependent` picks). Every
block size is a power of two: :func:`fits` says whether a model's widths allow one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from precision.channel_weights import is_channel_int8

__all__ = ["Norm", "fits", "norm_qkv", "gemv_add", "norm_swiglu", "norm_gemv", "BLOCK_K", "BLOCK_N"]

#: A weight's rows (outputs) a program owns, at most, and its contracted columns a loop iteration
#: streams, at least: fewer rows where that leaves fewer than :data:`PROGRAMS` programs (an H100 has
#: 132 SMs: a GEMV with 32 programs would stream on a quarter of them), longer tiles for fewer rows
#: (up to :data:`TILE` elements an iteration).
BLOCK_N, BLOCK_K, PROGRAMS, TILE = 128, 128, 256, 8192
F32 = jnp.float32
#: The activations :func:`norm_gemv` applies: GPT-2's ``gelu_new`` is the tanh approximation.
ACTIVATIONS = {"gelu_tanh": lambda y: jax.nn.gelu(y, approximate=True)}


class Norm(NamedTuple):
    """The norm before a projection: ``rms`` (Llama's: a ``weight``, rounded as the model rounds it)
    or ``layer`` (GPT-2's: a ``weight`` (scale) and a ``bias``, in float32), ``eps`` inside the root."""

    kind: str
    weight: jax.Array
    bias: jax.Array | None = None
    eps: float = 1e-5

    @property
    def operands(self) -> tuple:
        return (self.weight,) if self.bias is None else (self.weight, self.bias)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fits(batch: int, hidden: int, head_dim: int, *widths: int) -> bool:
    """Whether these kernels take a model: the batch and head width powers of two, and every
    contracted and produced width a multiple of 16 (its block: the largest power of two up to 128
    dividing it)."""
    return (_power_of_two(batch) and _power_of_two(head_dim) and head_dim >= 16
            and all(block(n, BLOCK_K) >= 16 for n in (hidden, *widths)))


def call_kernel(kernel, out_shape, grid, in_specs, out_specs, args, aliases=None):
    """``kernel`` as a Triton kernel on a GPU, interpreted elsewhere (the same program)."""
    def run(interpret: bool):
        extra = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=4, num_stages=3)}
        return lambda *a: pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                                         out_specs=out_specs, input_output_aliases=aliases or {},
                                         interpret=interpret, **extra)(*a)

    return jax.lax.platform_dependent(*args, cuda=run(False), default=run(True))


def whole(shape):
    """A block that is the whole array, for every program."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def block(n: int, size: int) -> int:
    """The largest power of two up to ``size`` that divides ``n``."""
    while n % size:
        size //= 2
    return size


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
        w = self.codes[rows, cols].astype(F32)
        if self.scales is not None:
            w = w * self.scales[rows, :].astype(F32)
        return w.astype(self.dtype).astype(F32)


def _columns(n: int) -> int:
    """The rows of an ``(n, k)`` weight one program owns (:data:`BLOCK_N`, :data:`PROGRAMS`)."""
    bn = BLOCK_N
    while bn > 16 and n // bn < PROGRAMS:
        bn //= 2
    return block(n, bn)


def _normalized(x_ref, norm: Norm, refs: list, dtype):
    """``x(cols)``: those columns of the normed rows (``norm``'s refs taken off the front of
    ``refs``), rounded to ``dtype`` as the model's norm hands them to its projection."""
    weight, bias = refs.pop(0), refs.pop(0) if norm.bias is not None else None
    b, d = x_ref.shape
    bk = block(d, TILE // b)  # Triton takes blocks of powers of two, not a whole row of 768

    def sums(i, acc):
        x = x_ref[:, pl.ds(i * bk, bk)].astype(F32)
        return acc[0] + jnp.sum(x, axis=1, keepdims=True), acc[1] + jnp.sum(x * x, axis=1, keepdims=True)

    total, squares = jax.lax.fori_loop(0, d // bk, sums, (jnp.zeros((b, 1), F32), jnp.zeros((b, 1), F32)))
    mean = total / d if norm.kind == "layer" else 0.0
    rstd = jax.lax.rsqrt(jnp.maximum(squares / d - mean * mean, 0.0) + norm.eps)  # Flax's (fast) variance

    def chunk(cols):
        x = (x_ref[:, cols].astype(F32) - mean) * rstd
        w = weight[cols].astype(F32)[None, :]
        if norm.kind == "rms":  # Llama's: rounded, then weighted and rounded again
            return (x.astype(dtype).astype(F32) * w).astype(dtype).astype(F32)
        return (x * w + bias[cols].astype(F32)[None, :]).astype(dtype).astype(F32)

    return chunk


def _projected(y, dtype, bias=None, first=0):
    """A projection's float32 sums ``y`` ``(B, width)`` as the model's layer gives them: rounded to
    ``dtype``, plus its bias (the ref, at ``first``) rounded again."""
    y = y.astype(dtype).astype(F32)
    if bias is None:
        return y
    return (y + bias[pl.ds(first, y.shape[1])].astype(F32)[None, :]).astype(dtype).astype(F32)


def _plain(x_ref, dtype):
    """``x(cols)``: those columns of the rows, rounded to ``dtype``."""
    return lambda cols: x_ref[:, cols].astype(dtype).astype(F32)


def _gemv(rows, w, first, width):
    """``rows @ w[first:first + width].T`` in float32 (``w`` a :class:`_WeightRefs`), ``rows(cols)``
    giving those columns of the contracted axis."""
    k = w.codes.shape[1]
    bk = block(k, max(BLOCK_K, TILE // width))

    def body(i, acc):
        cols = pl.ds(i * bk, bk)
        tile = w.tile(pl.ds(first, width), cols)  # (width, bk)
        return acc + jnp.sum(rows(cols)[:, None, :] * tile[None, :, :], axis=2)

    return jax.lax.fori_loop(0, k // bk, body, jnp.zeros((rows(pl.ds(0, bk)).shape[0], width), F32))


def _specs(*arrays):
    return [whole(a.shape) for a in arrays]


def norm_gemv(x, norm: Norm, w, bias=None, activation: str | None = None):
    """``activation(norm(x) @ w.T + bias)`` ``(B, n)`` in float32: ``x`` ``(B, d)``, ``w`` ``(n, d)``.
    With a bias or an activation (a layer inside the model) the projection's result is rounded to the
    weight's dtype as the model's layer gives it; without (a Llama's head), its float32 sums."""
    w = _Weight(w)
    b, bn = x.shape[0], _columns(w.n)
    rounded = bias is not None or activation is not None

    def kernel(x_ref, *refs):
        refs = list(refs)
        rows = _normalized(x_ref, norm, refs, w.dtype)
        weight, bias_ref, o_ref = w.take(refs), refs.pop(0) if bias is not None else None, refs[0]
        first = pl.program_id(0) * bn
        y = _gemv(rows, weight, first, bn)
        y = _projected(y, w.dtype, bias_ref, first) if rounded else y
        o_ref[...] = ACTIVATIONS[activation](y).astype(w.dtype).astype(F32) if activation else y

    args = (x, *norm.operands, *w.operands, *(() if bias is None else (bias,)))
    return call_kernel(kernel, jax.ShapeDtypeStruct((b, w.n), F32), (w.n // bn,), _specs(*args),
                       pl.BlockSpec((b, bn), lambda j: (0, j)), args)


def gemv_add(a, w, residual, bias=None):
    """``residual + (a @ w.T + bias)`` in float32: ``a`` ``(B, k)`` (rounded to the weight's dtype as
    it is read), ``w`` ``(d, k)``, ``residual`` ``(B, d)``; the projection rounded to the weight's
    dtype (and its bias added) as the model's layer gives it."""
    w = _Weight(w)
    b, bn = residual.shape[0], _columns(w.n)

    def kernel(a_ref, r_ref, *refs):
        refs = list(refs)
        weight, bias_ref, o_ref = w.take(refs), refs.pop(0) if bias is not None else None, refs[0]
        first = pl.program_id(0) * bn
        y = _projected(_gemv(_plain(a_ref, w.dtype), weight, first, bn), w.dtype, bias_ref, first)
        o_ref[...] = r_ref[...].astype(F32) + y

    extra = () if bias is None else (bias,)
    args = (a, residual, *w.operands, *extra)
    specs = [whole(a.shape), pl.BlockSpec((b, bn), lambda j: (0, j)), *_specs(*w.operands, *extra)]
    return call_kernel(kernel, jax.ShapeDtypeStruct((b, w.n), F32), (w.n // bn,), specs,
                       pl.BlockSpec((b, bn), lambda j: (0, j)), args)


def norm_swiglu(x, norm: Norm, gate, up):
    """``silu(norm(x) @ gate.T) * (norm(x) @ up.T)``, ``(B, hidden)``, rounded to the
    weights' dtype as the model's MLP computes it."""
    gate, up = _Weight(gate), _Weight(up)
    b, bn = x.shape[0], _columns(gate.n)

    def kernel(x_ref, *refs):
        refs = list(refs)
        rows = _normalized(x_ref, norm, refs, gate.dtype)
        g_w, u_w, o_ref = gate.take(refs), up.take(refs), refs[0]
        first = pl.program_id(0) * bn
        g = _projected(_gemv(rows, g_w, first, bn), gate.dtype)
        u = _projected(_gemv(rows, u_w, first, bn), up.dtype)
        o_ref[...] = ((g * jax.nn.sigmoid(g)).astype(gate.dtype).astype(F32) * u).astype(o_ref.dtype)

    args = (x, *norm.operands, *gate.operands, *up.operands)
    return call_kernel(kernel, jax.ShapeDtypeStruct((b, gate.n), gate.dtype), (gate.n // bn,), _specs(*args),
                       pl.BlockSpec((b, bn), lambda j: (0, j)), args)


def norm_qkv(x, norm: Norm, wq, wk, wv, sincos):
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

    def kernel(x_ref, sincos_ref, *refs):
        refs = list(refs)
        rows = _normalized(x_ref, norm, refs, wq.dtype)
        q_w, k_w, v_w, o_ref = wq.take(refs), wk.take(refs), wv.take(refs), refs[0]
        head, part = pl.program_id(0), pl.program_id(1)
        first = part * w

        def rotated(weight, h):
            lo = _projected(_gemv(rows, weight, h * hd + first, w), weight.dtype)
            hi = _projected(_gemv(rows, weight, h * hd + half + first, w), weight.dtype)
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
            o_ref[:, pl.ds(2 * first, 2 * w)] = _projected(value, wv.dtype)

    args = (x, sincos, *norm.operands, *wq.operands, *wk.operands, *wv.operands)
    return call_kernel(kernel, jax.ShapeDtypeStruct((b, (hq + 2 * hkv) * hd), F32), (hq + 2 * hkv, parts),
                       _specs(*args), pl.BlockSpec((b, hd), lambda h, p: (0, h)), args)
