"""Where a dimension of an operand goes in an op's result: the dimension bookkeeping the
tensor-parallel finder (:mod:`.finder`) follows a split dimension (or a param's) with."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

__all__ = ["Through", "reshape_groups", "through_reshape", "dot_output_dim", "dot_roles"]


class Through(NamedTuple):
    """Where a split dimension of a reshape's operand goes: ``dim`` in its result (None: nowhere
    it stays one contiguous block per device), ``size``: the size of the result dimension that
    takes the split (checked against the device count by the caller)."""

    dim: int | None
    size: int = 0


def reshape_groups(before: tuple[int, ...], after: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The dimensions of ``before`` and ``after`` in groups of equal product, in order (size-1
    dimensions join the group before them)."""
    groups, i, j = [], 0, 0
    while i < len(before) or j < len(after):
        ins, outs = [], []
        a = b = 1
        while i < len(before) or j < len(after):
            if ins and outs and a == b:
                break
            if (a <= b and i < len(before)) or j == len(after):
                a *= before[i]
                ins.append(i)
                i += 1
            else:
                b *= after[j]
                outs.append(j)
                j += 1
        while i < len(before) and before[i] == 1:
            ins.append(i)
            i += 1
        while j < len(after) and after[j] == 1:
            outs.append(j)
            j += 1
        groups.append((ins, outs))
    return groups


def through_reshape(before: tuple[int, ...], after: tuple[int, ...], dim: int) -> Through:
    """Where the split dimension ``dim`` of ``before`` goes in ``after``: split into several
    (features into heads) it goes to the first of them not of size 1; merged with others it
    goes to the merged dimension if it is the outermost of them (not of size 1)."""
    for ins, outs in reshape_groups(tuple(before), tuple(after)):
        if dim not in ins:
            continue
        real_ins = [d for d in ins if before[d] != 1]
        real_outs = [d for d in outs if after[d] != 1]
        if not real_outs or real_ins[:1] != [dim]:
            return Through(None)
        if len(real_ins) == 1 or len(real_outs) == 1:
            return Through(real_outs[0], after[real_outs[0]])
        return Through(None)
    return Through(None)


def dot_roles(eqn: Any, side: int) -> dict[int, tuple[str, int]]:
    """For each dimension of operand ``side`` (0: lhs, 1: rhs) of a ``dot_general``: ``("batch",
    out)``, ``("free", out)`` (its position in the result) or ``("contract", other)`` (the
    other operand's dimension it is contracted with)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    mine_c, other_c = (lc, rc) if side == 0 else (rc, lc)
    mine_b = lb if side == 0 else rb
    rank = len(eqn.invars[side].aval.shape)
    lhs_rank = len(eqn.invars[0].aval.shape)
    lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    roles: dict[int, tuple[str, int]] = {}
    for k, d in enumerate(mine_b):
        roles[d] = ("batch", k)
    for k, d in enumerate(mine_c):
        roles[d] = ("contract", other_c[k])
    free = [d for d in range(rank) if d not in mine_c and d not in mine_b]
    base = len(lb) + (0 if side == 0 else len(lhs_free))
    for k, d in enumerate(free):
        roles[d] = ("free", base + k)
    return roles


def dot_output_dim(eqn: Any, side: int, dim: int) -> int | None:
    """The result dimension a free dimension ``dim`` of operand ``side`` becomes (None: contracted)."""
    role, where = dot_roles(eqn, side)[dim]
    return where if role in ("free", "batch") else None


def prod(shape: Any) -> int:
    return math.prod(int(s) for s in shape)
