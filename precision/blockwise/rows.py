"""Which ops keep rows apart: the rules :mod:`.region` proves a loss row-wise with.

A value *carries rows* when its axis 0 holds the logits' rows, each row ``f`` consecutive
entries (its *row factor*: 1 for the logits, ``seq`` for ``[batch, seq, vocab]`` flattened
to ``[tokens, vocab]``). :func:`row_factors` propagates that from the head's input through
every op of a region, forward and back, to a fixpoint; each op's rule (:data:`_RULES`)
either says how its operands and results carry rows or raises :class:`NotRowWise`
(a reduction over the rows, a transpose moving them, an op no rule knows). Ops bound for a
reduce dtype (:func:`reduced_op`) are judged by the op they bind.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend.core import Literal

from precision.autocast.reductions import read_scope
from precision.autocast.split_sums import SplitSums, wider_sums
from precision.blockwise.program import Op, Program
from precision.losses import CROSS_ENTROPY_SCOPE

__all__ = ["NotRowWise", "is_cross_entropy", "reduced_op", "row_factors", "unwrapped"]

_ELEMENTWISE = {
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "clamp",
    "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2",
    "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "digamma", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "reduce_precision",
    "rem", "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan",
    "tanh", "xor", "_alias", "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
}
_REDUCTIONS = {"reduce_max", "reduce_min", "reduce_sum", "reduce_prod", "reduce_and", "reduce_or", "argmax",
               "argmin"}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}


class NotRowWise(Exception):
    """The candidate region mixes rows (or reads something it cannot block): left as written."""


def row_factors(program: Program, region: set[int], head: int) -> dict[int, int]:
    """The values of ``region`` that carry rows, each with its row factor: a value of factor
    ``f`` has ``rows * f`` entries on axis 0, row ``r`` of the logits being entries
    ``r * f .. (r + 1) * f - 1`` (a ``[batch, seq, vocab]`` flattened to ``[tokens, vocab]``
    has factor ``seq``). To a fixpoint of :data:`_RULES`."""
    ops, avals = program.ops, program.avals
    n = avals[ops[head].outs[0]].shape[0]
    rows = {ops[head].ins[0]: 1, ops[head].outs[0]: 1}
    order = sorted(region)
    while True:
        before = dict(rows)
        for i in order:
            op = unwrapped(ops[i])
            rule = _RULES.get(op.name, _elementwise if op.name in _ELEMENTWISE else None)
            if rule is None:
                if is_cross_entropy(ops[i]):
                    rule = _elementwise
                else:
                    raise NotRowWise(f"{op.name} is not known to keep rows apart")
            rule(op, rows, avals, n)
        if rows == before:
            break
    for v, f in rows.items():
        shape = avals[v].shape
        if not shape or shape[0] != n * f:
            raise NotRowWise(f"value {v} of shape {shape} would carry rows")
    return rows


def reduced_op(op: Op) -> tuple[Op, Any, list[bool], SplitSums] | None:
    """A custom-VJP call of :func:`precision.autocast.reductions.bind` (a param's gradient in a
    reduce dtype): the op it binds, on the call's operands and results, with its reduce dtype,
    which operands are params and its sums split across devices (:mod:`precision.autocast.split_sums`:
    a vocabulary head's input gradient, summed across the vocabulary's shards); None for any other op."""
    if op.name != "custom_vjp_call":
        return None
    scopes = [e.name for e in getattr(op.eqn.source_info.name_stack, "stack", ()) if hasattr(e, "name")]
    found = read_scope(scopes[-1]) if scopes else None
    inner = [e for e in op.params["call_jaxpr"].jaxpr.eqns if e.primitive.name != "convert_element_type"]
    if found is None or len(inner) != 1:
        return None
    operand = inner[0].invars[0].aval.dtype
    return Op(inner[0], op.ins, op.outs), *found, wider_sums(inner[0].primitive.name, tuple(scopes), operand)


def unwrapped(op: Op) -> Op:
    """The op itself, or the op a reduce-dtype call binds (:func:`reduced_op`)."""
    reduced = reduced_op(op)
    return op if reduced is None else reduced[0]


def is_cross_entropy(op: Any) -> bool:
    """Whether ``op`` is :func:`precision.losses.cross_entropy`'s custom-VJP call (by its scope)."""
    stack = getattr(op.eqn.source_info.name_stack, "stack", ())
    return op.name == "custom_vjp_call" and any(getattr(e, "name", None) == CROSS_ENTROPY_SCOPE for e in stack)


def _shape(avals: dict, x: Any) -> tuple:
    return tuple(np.shape(x.val)) if isinstance(x, Literal) else tuple(avals[x].shape)


def _is_row(rows: dict, x: Any) -> bool:
    return not isinstance(x, Literal) and x in rows


def _mark(rows: dict, x: Any, factor: int) -> None:
    if isinstance(x, Literal):
        raise NotRowWise("a literal would carry rows")
    if rows.get(x, factor) != factor:
        raise NotRowWise("a value grouping its rows two ways")
    rows[x] = factor


def _elementwise(op: Any, rows: dict, avals: dict, n: int) -> None:
    """Operands and results with as many entries on axis 0 as a row value among them pair
    entry i with entry i: they carry rows with its factor. Scalars and operands of one
    entry on axis 0 broadcast to every row."""
    values = [x for x in (*op.ins, *op.outs) if len(_shape(avals, x)) > 0]
    carrying = [x for x in values if _is_row(rows, x)]
    if not carrying:
        return
    factor = rows[carrying[0]]
    for x in values:
        if _shape(avals, x)[0] == n * factor:
            _mark(rows, x, factor)
        elif _shape(avals, x)[0] != 1:
            raise NotRowWise(f"{op.name} pairs {n * factor} entries with {_shape(avals, x)[0]}")


def _broadcast(op: Any, rows: dict, avals: dict, n: int) -> None:
    (x, *_), (out,) = op.ins, op.outs
    maps_axis0 = op.params["broadcast_dimensions"][:1] == (0,) and _shape(avals, x)[:1] == _shape(avals, out)[:1]
    if maps_axis0 and (_is_row(rows, x) or out in rows):
        factor = rows.get(x) if _is_row(rows, x) else rows[out]
        _mark(rows, x, factor)
        _mark(rows, out, factor)
    elif not maps_axis0 and _is_row(rows, x):
        raise NotRowWise("rows broadcast to another axis")


def _reshape(op: Any, rows: dict, avals: dict, n: int) -> None:
    """Rows stay rows through any reshape whose first axes, before and after, are whole
    numbers of rows (a reshape keeps the flat order, in which each row is contiguous)."""
    (x, *_), (out,) = op.ins, op.outs
    if _is_row(rows, x) or out in rows:
        before, after = _shape(avals, x)[:1], _shape(avals, out)[:1]
        if op.params.get("dimensions") is not None or not before or not after or before[0] % n or after[0] % n:
            raise NotRowWise("a reshape across rows")
        _mark(rows, x, before[0] // n)
        _mark(rows, out, after[0] // n)


def _reduction(op: Any, rows: dict, avals: dict, n: int) -> None:
    (x, *_), outs = op.ins, op.outs
    if _is_row(rows, x) or any(o in rows for o in outs):
        if 0 in op.params["axes"]:
            raise NotRowWise("a reduction over the rows")
        factor = rows[x] if _is_row(rows, x) else next(rows[o] for o in outs if o in rows)
        _mark(rows, x, factor)
        for o in outs:
            _mark(rows, o, factor)


def _along_other_axis(key: str) -> Any:
    def rule(op: Any, rows: dict, avals: dict, n: int) -> None:
        value = op.params[key]
        axes = value if isinstance(value, tuple) else (value,)
        if 0 in axes and any(_is_row(rows, x) for x in (*op.ins, *op.outs)):
            raise NotRowWise(f"{op.name} along the rows")
        _elementwise(op, rows, avals, n)
    return rule


def _iota(op: Any, rows: dict, avals: dict, n: int) -> None:
    if op.outs[0] in rows and op.params["dimension"] == 0:
        raise NotRowWise("an iota along the rows")


def _transpose(op: Any, rows: dict, avals: dict, n: int) -> None:
    if op.params["permutation"][:1] != (0,) and any(_is_row(rows, x) for x in (*op.ins, *op.outs)):
        raise NotRowWise("a transpose moving the rows")
    _elementwise(op, rows, avals, n)


def _dot(op: Any, rows: dict, avals: dict, n: int) -> None:
    lhs, rhs = op.ins
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    if _is_row(rows, rhs):
        raise NotRowWise("a matmul reading rows on its right")
    if _is_row(rows, lhs) or op.outs[0] in rows:
        if lb or 0 in lc:
            raise NotRowWise("a matmul contracting the rows")
        factor = rows[lhs] if _is_row(rows, lhs) else rows[op.outs[0]]
        _mark(rows, lhs, factor)
        _mark(rows, op.outs[0], factor)


def _gather(op: Any, rows: dict, avals: dict, n: int) -> None:
    operand, indices = op.ins
    (out,) = op.outs
    dn = op.params["dimension_numbers"]
    touched = [x for x in (operand, indices, out) if _is_row(rows, x)]
    if not touched:
        return
    factor = rows[touched[0]]
    if 0 in dn.operand_batching_dims:  # take_along_axis: row i's indices pick from row i
        at = dn.operand_batching_dims.index(0)
        if dn.start_indices_batching_dims[at] != 0 or 0 in dn.offset_dims:
            raise NotRowWise("a gather pairing rows otherwise")
        for x in (operand, indices, out):
            _mark(rows, x, factor)
    elif 0 not in (*dn.collapsed_slice_dims, *dn.start_index_map) and dn.offset_dims[:1] == (0,) \
            and not _is_row(rows, indices):  # a slice of every row
        _mark(rows, operand, factor)
        _mark(rows, out, factor)
    elif not _is_row(rows, operand) and 0 not in dn.offset_dims:
        _mark(rows, indices, factor)  # rows of indices into a table (an embedding lookup)
        _mark(rows, out, factor)
    else:
        raise NotRowWise("a gather across rows")


def _slice(op: Any, rows: dict, avals: dict, n: int) -> None:
    (x,), strides = op.ins, op.params.get("strides") or (1,)
    full = _shape(avals, x)[:1]
    if op.params["start_indices"][0] != 0 or (op.params["limit_indices"][0],) != full or strides[0] != 1:
        if any(_is_row(rows, v) for v in (*op.ins, *op.outs)):
            raise NotRowWise("a slice of the rows")
    _elementwise(op, rows, avals, n)


def _pad(op: Any, rows: dict, avals: dict, n: int) -> None:
    if tuple(op.params["padding_config"][0]) != (0, 0, 0) and any(_is_row(rows, x) for x in (*op.ins, *op.outs)):
        raise NotRowWise("padding of the rows")
    x, _ = op.ins
    _elementwise(op._replace(ins=(x,)), rows, avals, n)


_RULES = {
    "broadcast_in_dim": _broadcast, "reshape": _reshape, "iota": _iota, "transpose": _transpose,
    "dot_general": _dot, "gather": _gather, "slice": _slice, "pad": _pad,
    "concatenate": _along_other_axis("dimension"), "squeeze": _along_other_axis("dimensions"),
    "rev": _along_other_axis("dimensions"), "sort": _along_other_axis("dimension"),
    **{name: _reduction for name in _REDUCTIONS}, **{name: _along_other_axis("axis") for name in _CUMULATIVE},
    "_const": lambda op, rows, avals, n: None,
}
