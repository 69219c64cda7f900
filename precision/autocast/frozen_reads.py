"""Matmuls reading a frozen weight stored in codes: their backward pass dequantizes it again.

A weight stored in 8 or 4 bits (:class:`precision.QuantizedWeight`, a fine-tuned model's
frozen base) is read by the program as floats, made by a sub-program named
:data:`precision.quantized_weights.READ`. A matmul's backward pass reads its weight again
(``dx = dy @ Wᵀ``): differentiated as written, the weight as the matmul reads it (its
bfloat16 copy) is a residual, which XLA computes in the forward pass and keeps until the
backward one: a bfloat16 copy of the frozen base per matmul, live at once, where the base
itself takes 1 byte per value (int8) or half a byte (nf4).

Here, as in bitsandbytes' 4-bit matmul, such a matmul is a ``custom_vjp`` whose residuals
are the weight's codes and scales (held anyway: they are the weight) and whose backward
makes the weight again from them. The interpreter keeps, with each value made from a
weight's codes, how to make it again (:class:`Source`): from the read (:func:`read`),
through moves and casts (:func:`follow`) and inlined ``jit`` calls; :func:`product` binds a
``dot_general`` reading such a value. Forward and backward bind the ops JAX's own rules bind
on the same values, so results and gradients are bit-identical. A weight entering a loop,
a remat block or a branch is read there as before (its dequantized copy kept).

A weight in int8 with a scale per output channel (:class:`precision.ChannelInt8`, read by
:data:`precision.channel_weights.CHANNEL_READ`) is kept factored as well (:class:`Channel`:
its codes, and its scales moved as the weight is, through transposes and casts): a product
contracting exactly the axes its scales are constant along is ``(x . codes) * scales``, the
codes cast to the compute dtype (exactly: integers to 127), the product accumulated in float32
and scaled there (:func:`product`). XLA fuses an int8-to-bfloat16 cast into a GEMM's operand,
where it writes ``codes * scales`` whole first: the weight is read once, in int8.

A weight in blocks of codes laid out for decoding (:class:`precision.block_codes.BlockCodes`,
read by a sub-program named in :data:`precision.block_codes.BLOCK_READS`; a served nf4 base) is
kept factored too (:class:`Blocks`: its codes and scales, the axis its matmuls contract, and
whether it has been transposed since): a product with few rows of input
(:data:`precision.block_codes.FEW_ROWS`: a decode step's) contracting that axis is, on a GPU,
:func:`precision.block_codes.block_product`, one kernel reading each code once; any other, and
any on another platform (XLA:CPU runs that sum 5x slower), reads the weight dequantized. Rows
of such a table looked up (an embedding, tied or not) are its rows' codes gathered and
dequantized (:func:`lookup`), where the gather of the weight read it all.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero

from precision.autocast import reductions
from precision.autocast.program import MOVES
from precision.autocast.values import Kind, Val, cast, is_policy_float
from precision.block_codes import BLOCK_READS, FEW_ROWS, block_product, dequantize_rows
from precision.channel_weights import CHANNEL_READ
from precision.quantized_weights import READ

__all__ = ["Source", "Channel", "Blocks", "is_read", "read", "follow", "product", "lookup"]

#: Ops whose result is their first operand moved or cast: a weight's codes still make it.
_FOLLOWED = MOVES | {"convert_element_type"}


class Channel(NamedTuple):
    """A weight as int8 ``codes`` (a :class:`Source` of them, moved as the weight is) times
    ``scales`` (the program's float32 array, moved alike: 1 on each axis it is constant along)."""

    codes: "Source"
    scales: Any


class Blocks(NamedTuple):
    """A 2-D weight as a :class:`precision.block_codes.BlockCodes`' ``codes`` and ``scales`` (the
    program's arrays), in ``code``, ``contracted`` on that axis as read, read in ``dtype``;
    ``transposed`` since."""

    codes: Any
    scales: Any
    code: str
    contracted: int
    dtype: Any
    transposed: bool = False


class Source(NamedTuple):
    """How a value is made from a weight's codes: ``fn(*args)``, where ``args`` are the codes
    and scales as the program holds them and ``fn`` closes over no traced value; ``channel``:
    the same weight factored (int8 with a scale per output channel), else None; ``blocks``: the
    same weight in blocks of codes laid out for decoding, else None."""

    args: tuple
    fn: Callable
    channel: Channel | None = None
    blocks: Blocks | None = None

    def then(self, step: Callable[[Any], Any]) -> "Source":
        """The value ``step`` makes of this one (no longer factored)."""
        fn = self.fn
        return Source(self.args, lambda *args: step(fn(*args)))


def is_read(eqn: Any) -> bool:
    """Whether ``eqn`` is a named sub-program that dequantizes a weight."""
    return eqn.primitive.name in ("pjit", "jit") and eqn.params.get("name") in (READ, CHANNEL_READ,
                                                                               *BLOCK_READS.values())


def read(site: Any, ins: list[Val]) -> list[Val]:
    """The weight a :data:`READ` call makes, held as autocast holds a param (its stored dtype),
    with its :class:`Source`. ``site``: the interpreter's :class:`~.interpreter.Site`."""
    eqn = site.eqn
    args = tuple(v.as_dtype(var.aval.dtype) if v.managed else v.array for v, var in zip(ins, eqn.invars))
    stored = _stored_dtype(eqn.params["jaxpr"])

    def fn(*xs: Any) -> Any:
        (weight,) = eqn.primitive.bind(*xs, **eqn.params)
        return weight if weight.dtype == stored else cast(weight, stored, saturate=False)

    if not is_policy_float(stored):
        return [Val(Kind.KEEP, fn(*args), site.path)]
    channel = blocks = None
    if eqn.params["name"] == CHANNEL_READ:  # its leaves: codes, scales
        channel = Channel(Source(args[:1], lambda codes: codes), args[1])
    if eqn.params["name"] in BLOCK_READS.values():  # its leaves: codes (nf4: uint8, int8: int8), scales
        contracted = next(axis for axis, name in BLOCK_READS.items() if name == eqn.params["name"])
        blocks = Blocks(args[0], args[1], "int8" if np.dtype(args[0].dtype) == np.int8 else "nf4", contracted, stored)
    return [Val(Kind.HALF, fn(*args), site.path, leaf=True, source=Source(args, fn, channel, blocks))]


def _stored_dtype(closed: Any) -> np.dtype:
    """The dtype a read weight is stored in: the read widens a half one to float32 last."""
    jaxpr = getattr(closed, "jaxpr", closed)
    out = jaxpr.outvars[0]
    last = next((e for e in reversed(jaxpr.eqns) if out in e.outvars), None)
    if last is not None and last.primitive.name == "convert_element_type":
        return np.dtype(last.invars[0].aval.dtype)
    return np.dtype(out.aval.dtype)


def follow(site: Any, ins: list[Val], outs: list[Val]) -> None:
    """Gives the result of a move or cast of a value made from codes (a reshape, a transpose,
    a cast to the compute dtype) its :class:`Source`: the same op on the operand cast as the
    interpreter cast it (moves keep their operand's dtype)."""
    if site.name not in _FOLLOWED or len(outs) != 1 or not ins or ins[0].source is None or outs[0] is ins[0]:
        return
    if any(v.source is not None or isinstance(v.array, jax.core.Tracer) for v in ins[1:]):
        return  # indices the program computes (a dynamic slice): not followed
    out, rest, eqn = outs[0], [v.array for v in ins[1:]], site.eqn
    dtype = out.dtype

    def step(x: Any) -> Any:
        x = x if x.dtype == dtype else cast(x, dtype, saturate=False)
        return x if eqn.primitive.name == "convert_element_type" else eqn.primitive.bind(x, *rest, **eqn.params)

    source = ins[0].source.then(step)
    made = jax.eval_shape(source.fn, *source.args)
    if made.shape == np.shape(out.array) and made.dtype == dtype:
        out.source = source._replace(channel=_moved(ins[0].source.channel, eqn),
                                     blocks=_moved_blocks(ins[0].source.blocks, eqn))


def _moved(channel: Channel | None, eqn: Any) -> Channel | None:
    """``channel`` after ``eqn``: cast (the codes stay integers), transposed (codes and scales
    alike); any other move makes it no longer factored (None)."""
    if channel is None or eqn.primitive.name == "convert_element_type":
        return channel
    if eqn.primitive.name != "transpose":
        return None
    moved = lambda x: eqn.primitive.bind(x, **eqn.params)  # noqa: E731
    return Channel(channel.codes.then(moved), moved(channel.scales))


def lookup(site: Any, ins: list[Val], outs: list[Val]) -> None:
    """Replaces ``outs[0]`` by the rows a ``gather`` takes of a table in blocks of codes along its
    rows (:class:`Blocks` contracted on axis 1: an embedding), made from those rows' codes and
    scales alone, the same values (each computed and rounded as the whole table's read computes
    it): the gather of the dequantized table read all of it (an nf4 Llama-3-8B embedding: 295 MB
    a token)."""
    if site.name != "gather" or len(outs) != 1 or len(ins) != 2 or ins[0].source is None:
        return
    blocks, params, table = ins[0].source.blocks, site.eqn.params, np.shape(ins[0].array)
    dims, out = params["dimension_numbers"], outs[0].array
    if (blocks is None or blocks.contracted != 1 or blocks.transposed or len(table) != 2
            or tuple(dims.collapsed_slice_dims) != (0,) or tuple(dims.start_index_map) != (0,)
            or tuple(dims.offset_dims) != (np.ndim(out) - 1,) or tuple(params["slice_sizes"]) != (1, table[1])
            or tuple(dims.operand_batching_dims) or np.shape(ins[1].array)[-1:] != (1,)):
        return
    rows = ins[1].array[..., 0]
    values = dequantize_rows(blocks.codes, blocks.scales, blocks.code, rows.reshape(-1))
    values = values.reshape(*rows.shape, table[1]).astype(blocks.dtype).astype(out.dtype)
    if params["mode"] == jax.lax.GatherScatterMode.FILL_OR_DROP:  # rows out of the table: the fill, as gather's
        fill = params["fill_value"]
        inside = (rows >= 0) & (rows < table[0])
        values = jax.numpy.where(inside[..., None], values, jax.numpy.asarray(np.nan if fill is None else fill,
                                                                                out.dtype))
    outs[0] = Val(outs[0].kind, values, outs[0].path)


def _moved_blocks(blocks: Blocks | None, eqn: Any) -> Blocks | None:
    """``blocks`` after ``eqn``: cast, or transposed (2-D); any other move: no longer factored."""
    if blocks is None or eqn.primitive.name == "convert_element_type":
        return blocks
    if eqn.primitive.name == "transpose" and tuple(eqn.params["permutation"]) == (1, 0):
        return blocks._replace(transposed=not blocks.transposed)
    return None


def product(site: Any, ins: list[Val], args: list[Any], params: dict, reduce_dtype: Any = None) -> Any:
    """``dot_general`` of ``args`` (the operands as the interpreter casts them) with ``params``,
    whose backward pass makes the weight again from its codes, where exactly one operand is
    made from codes and no param's gradient is asked for in ``reduce_dtype`` (bound by
    :mod:`.reductions` then); None elsewhere (bound as written)."""
    if site.name != "dot_general":
        return None
    made = [i for i, v in enumerate(ins) if v.source is not None]
    if len(made) != 1 or reductions.applies(site.eqn.primitive, args, [v.leaf and v.managed for v in ins], reduce_dtype):
        return None
    k = made[0]
    scaled = _scaled_product(site.eqn.primitive, ins[k].source.channel, k, args, params)
    if scaled is not None:
        return scaled
    dtype = np.dtype(args[k].dtype)
    weight = ins[k].source.then(lambda w: w if w.dtype == dtype else cast(w, dtype, saturate=False))
    other = args[1 - k]
    dot = _frozen_dot(site.eqn.primitive, params, k, weight.fn, jax.ShapeDtypeStruct(np.shape(other), other.dtype))
    few = _few_rows_product(site.eqn.primitive, ins[k].source.blocks, k, args, params)
    if few is not None:  # on a GPU; XLA:CPU runs that sum 5x slower than the dequantized weight's dot
        return jax.lax.platform_dependent(other, *weight.args, cuda=few, rocm=few, default=dot)
    return dot(other, *weight.args)


def _scaled_product(primitive: Any, channel: Channel | None, k: int, args: list[Any], params: dict) -> Any:
    """``(x . codes) * scales`` for a product whose operand ``k`` is ``channel``'s weight and
    which contracts exactly the axes its scales are constant along; None elsewhere."""
    if channel is None:
        return None
    (contracting, batch), shape = params["dimension_numbers"], np.shape(args[k])
    contracted, batched, scales = tuple(contracting[k]), tuple(batch[k]), channel.scales
    if any(np.shape(scales)[a] != (1 if a in contracted else shape[a]) for a in range(len(shape)) if shape[a] != 1):
        return None
    free = [a for a in range(len(shape)) if a not in contracted and a not in batched]
    other = args[1 - k]
    others = [1] * (np.ndim(other) - len(contracted) - len(batched))
    sizes = [shape[a] for a in batched] + ([*others, *(shape[a] for a in free)] if k == 1
                                           else [*(shape[a] for a in free), *others])
    per_output = jax.numpy.transpose(scales, [*batched, *free, *contracted]).reshape(sizes)
    out_dtype = jax.eval_shape(lambda a, b: primitive.bind(a, b, **params), *args).dtype
    dtype = np.dtype(args[k].dtype)
    codes = channel.codes.then(lambda c: c.astype(dtype))
    wide = {**params, "preferred_element_type": np.dtype(np.float32)}
    dot = _frozen_dot(primitive, wide, k, codes.fn, jax.ShapeDtypeStruct(np.shape(other), other.dtype))
    return (dot(other, *codes.args) * per_output).astype(out_dtype)


def _few_rows_product(primitive: Any, blocks: Blocks | None, k: int, args: list[Any], params: dict) -> Any:
    """``(x, codes, scales) -> x . W`` by :func:`precision.block_codes.block_product`, for a product
    whose operand ``k`` is ``blocks``' weight, contracting its axis alone, with at most
    :data:`FEW_ROWS` rows of the other operand ``x``; None elsewhere."""
    if blocks is None or np.ndim(args[k]) != 2:
        return None
    (contracting, batch), other = params["dimension_numbers"], args[1 - k]
    if tuple(batch[0]) or tuple(contracting[k]) != (blocks.contracted ^ blocks.transposed,):
        return None
    axis = contracting[1 - k][0]
    if np.size(other) // np.shape(other)[axis] > FEW_ROWS:
        return None
    out_dtype = jax.eval_shape(lambda a, b: primitive.bind(a, b, **params), *args).dtype

    def few(x: Any, codes: Any, scales: Any) -> Any:
        y = block_product(jax.numpy.moveaxis(x, axis, -1), codes, scales, blocks.code, blocks.contracted,
                          np.dtype(args[k].dtype))
        return (y if k == 1 else jax.numpy.moveaxis(y, -1, 0)).astype(out_dtype)  # dot_general: lhs's axes first

    return few


def _frozen_dot(primitive: Any, params: dict, k: int, rebuild: Callable, other: Any) -> Callable:
    """``dot(x, *weight_args)``: ``primitive`` on ``x`` and ``rebuild(*weight_args)`` (the
    weight at operand ``k``), whose residuals are ``weight_args``. The backward pass is the
    product's own transpose rule on the weight made again; the weight's own gradient (only
    where its scales are differentiated) keeps ``x`` too."""

    def bound(x: Any, weight: Any) -> Any:
        return primitive.bind(*((x, weight) if k == 1 else (weight, x)), **params)

    @jax.custom_vjp
    def dot(x: Any, *weight_args: Any) -> Any:
        return bound(x, rebuild(*weight_args))

    def forward(x: Any, *weight_args: Any) -> tuple[Any, tuple]:
        values = tuple(a.value for a in weight_args)
        differentiated = any(a.perturbed for a in weight_args)
        return bound(x.value, rebuild(*values)), (values, x.value if differentiated else None)

    def backward(residuals: tuple, ct: Any) -> tuple:
        values, x = residuals
        if isinstance(ct, SymbolicZero):
            return (None,) * (1 + len(values))
        values, ct = jax.lax.optimization_barrier((values, ct))  # made again here, after ct: not CSE'd with forward's
        weight = rebuild(*values)
        (dx,) = jax.linear_transpose(lambda a: bound(a, weight), other)(ct)
        if x is None:
            return (dx, *([None] * len(values)))
        _, pull = jax.vjp(lambda *w: bound(x, rebuild(*w)), *values)
        return (dx, *pull(ct))

    dot.defvjp(forward, backward, symbolic_zeros=True)
    return dot

