"""Where a program computes a loss from whole logits, and whether it can be computed in row blocks.

The head is a matmul whose result (the logits, ``[rows, ..., vocabulary]``) is the largest
value of the program. The region is every operation from the head to the last one that
reads a value of the logits' size (a softmax, a log-sum-exp, the label's logit, label
smoothing, a z-loss), plus what only the region reads (the labels' one-hot, the head's
weights cast to the compute dtype). The region can be computed a block of rows at a time
when it is row-wise: each row of each result depends on the same row of the inputs only.
:func:`find_region` proves that op by op (:mod:`.rows`: an elementwise op keeps rows
apart, a reduction over axis 0 does not...), finds which values carry rows (from the head's
input, through each op, and back to what they are combined with), and refuses a region
that is not row-wise or whose logits-sized values are read outside it (the logits also
returned, or kept): those programs stay as written.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from precision.blockwise.program import Program, nbytes
from precision.blockwise.rows import NotRowWise, reduced_op, row_factors, unwrapped

__all__ = ["Region", "NotRowWise", "find_region", "reduced_op", "why_not"]


class Region(NamedTuple):
    """A loss computed from the logits, row-wise, in ``program``'s op indices."""

    head: int  # the matmul that makes the logits
    ops: tuple[int, ...]  # in program order, the head included
    row_inputs: tuple[int, ...]  # values from outside, one row per logits row: taken a block at a time
    invariant_inputs: tuple  # values from outside read whole by every block (weights, constants)
    outputs: tuple[int, ...]  # row values read after the region (per-token losses, metrics)
    rows: int  # the logits' leading dimension
    rows_of: dict  # every value of the region that carries rows (axis 0): its row factor
    big_bytes: int  # bytes of the region's logits-sized values, whole
    cast_from: dict  # invariant input -> (the function input it is a narrowing cast of, arranging ops after)


def find_region(program: Program, min_logits_bytes: int) -> Region | None:
    """The row-wise loss region of the largest head matmul of at least ``min_logits_bytes``
    (counted in float32), or None (:func:`why_not` says why)."""
    return _find(program, min_logits_bytes)[0]


def why_not(program: Program, min_logits_bytes: int) -> str:
    """Why :func:`find_region` finds no region in ``program``."""
    region, reason = _find(program, min_logits_bytes)
    return "" if region is not None else reason


def _find(program: Program, min_logits_bytes: int) -> tuple[Region | None, str]:
    producers = {out: i for i, op in enumerate(program.ops) for out in op.outs}
    consumers: dict[int, list[int]] = {}
    for i, op in enumerate(program.ops):
        for x in op.ins:
            if not isinstance(x, Literal):
                consumers.setdefault(x, []).append(i)
    reasons = []
    for head in _heads(program, min_logits_bytes):
        try:
            return _region(program, head, producers, consumers), ""
        except NotRowWise as e:
            shape = list(program.avals[program.ops[head].outs[0]].shape)
            reasons.append(f"the loss from the logits {shape} is not computed row by row: {e}")
    if reasons:
        return None, reasons[0]
    largest = max((program.avals[op.outs[0]] for op in program.ops if unwrapped(op).name == "dot_general"),
                  key=lambda a: int(np.prod(a.shape)), default=None)
    if largest is None:
        return None, "no matmul"
    size = int(np.prod(largest.shape)) * 4
    return None, (f"the largest matmul result, {list(largest.shape)}, is {size / 2**20:.1f} MiB in float32, below "
                  f"{min_logits_bytes / 2**20:.0f} MiB: whole is cheaper")


def _heads(program: Program, min_logits_bytes: int) -> list[int]:
    """Matmuls whose result could be logits, largest first: no batch dimensions, the left
    operand's axis 0 kept as the result's axis 0."""
    found = []
    for i, op in enumerate(program.ops):
        op = unwrapped(op)
        if op.name != "dot_general":
            continue
        out = program.avals[op.outs[0]]
        (lhs_contract, _), (lhs_batch, _) = op.params["dimension_numbers"]
        if len(out.shape) < 2 or lhs_batch or 0 in lhs_contract or isinstance(op.ins[0], Literal):
            continue
        if int(np.prod(out.shape)) * 4 >= min_logits_bytes:
            found.append((-int(np.prod(out.shape)), i))
    return [i for _, i in sorted(found)]


def _region(program: Program, head: int, producers: dict, consumers: dict) -> Region:
    ops = program.ops
    logits = ops[head].outs[0]
    size = int(np.prod(program.avals[logits].shape))
    big = lambda v: not isinstance(v, Literal) and int(np.prod(program.avals[v].shape)) * 2 >= size  # noqa: E731
    descendants = _descendants(head, ops, consumers)
    readers = {i for i in descendants if any(big(x) for x in ops[i].ins)} | {head}
    region = _ancestors_within(readers, descendants, ops, producers)
    region = _pull_in(region, ops, producers, consumers, big)
    rows_of = row_factors(program, region, head)
    inputs = {x for i in region for x in ops[i].ins if not isinstance(x, Literal) and producers.get(x) not in region}
    outputs = {out for i in region for out in ops[i].outs
               if any(c not in region for c in consumers.get(out, ())) or out in program.outputs}
    for out in outputs:
        if out not in rows_of or big(out):
            raise NotRowWise(f"value {out} leaves the region whole")
    n = program.avals[logits].shape[0]
    row_inputs = tuple(sorted(x for x in inputs if x in rows_of))
    invariant = tuple(sorted(x for x in inputs if x not in rows_of))
    big_bytes = sum(nbytes(program.avals[v]) for i in region for v in ops[i].outs if big(v))
    return Region(head, tuple(sorted(region)), row_inputs, invariant, tuple(sorted(outputs)), n,
                  rows_of, big_bytes, _casts(invariant, ops, producers, set(program.inputs)))


def _descendants(head: int, ops: list, consumers: dict) -> set[int]:
    found, todo = {head}, [head]
    while todo:
        for out in ops[todo.pop()].outs:
            for c in consumers.get(out, ()):
                if c not in found:
                    found.add(c)
                    todo.append(c)
    return found


def _ancestors_within(start: set[int], within: set[int], ops: list, producers: dict) -> set[int]:
    found, todo = set(start), list(start)
    while todo:
        for x in ops[todo.pop()].ins:
            p = producers.get(x) if not isinstance(x, Literal) else None
            if p is not None and p in within and p not in found:
                found.add(p)
                todo.append(p)
    return found


def _pull_in(region: set[int], ops: list, producers: dict, consumers: dict, big: Any) -> set[int]:
    """Adds what only the region reads and is better made a block at a time: a logits-sized
    value (the labels' one-hot, smoothed targets)."""
    changed = True
    while changed:
        changed = False
        for x in {x for i in region for x in ops[i].ins if not isinstance(x, Literal)}:
            p = producers.get(x)
            if p is None or p in region or not big(x):
                continue
            if all(c in region for out in ops[p].outs for c in consumers.get(out, ())):
                region.add(p)
                changed = True
    return region


#: Ops that only arrange a value (a bias reshaped to broadcast, a tied embedding transposed).
_ARRANGING = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "_alias"})


def _casts(invariant: tuple, ops: list, producers: dict, inputs: set[int]) -> dict[int, tuple[int, tuple]]:
    """The invariant inputs that are a function input cast to a narrower float (a weight's
    float32 master in the compute dtype), then perhaps arranged (reshaped, transposed):
    ``{input: (master, the arranging ops after the cast)}``. The blocks read the cast and send
    its gradient to the master arranged the same way, summed over blocks in the master's dtype."""
    found = {}
    for x in invariant:
        chain, value = [], x
        while (p := producers.get(value)) is not None and ops[p].name in _ARRANGING:
            chain.append(p)
            value = ops[p].ins[0]
        p = producers.get(value)
        if p is not None and _narrowing_cast(ops[p]) and ops[p].ins[0] in inputs:
            found[x] = (ops[p].ins[0], tuple(reversed(chain)))
    return found


def _narrowing_cast(op: Any) -> bool:
    if op.name != "convert_element_type" or isinstance(op.ins[0], Literal):
        return False
    new = np.dtype(op.params["new_dtype"])
    return bool(jnp.issubdtype(new, jnp.floating)) and new.itemsize < 4
