"""Params as a layer reads them: which ops keep a value a param (a *leaf*: an input of the
program, moved, cast or looked up at constant indices), whose gradients a data-parallel step
reduces across devices (:mod:`.reductions`)."""

from __future__ import annotations

import numpy as np

from precision.autocast import reductions
from precision.autocast.context import Site
from precision.autocast.values import Kind, Val, is_policy_float

__all__ = ["keeps_leaf", "moves_a_leaf"]


def keeps_leaf(site: Site, ins: list[Val]) -> bool:
    """Whether the op's results are still the param its first operand is: it moves or
    casts it, or looks it up at constant indices (a position table read at
    ``arange(length)``: the same rows for every example, so its gradient is a
    sum over the batch, like a bias's)."""
    if not ins or not ins[0].leaf:
        return False
    return site.name in reductions.MOVES or (site.name == "gather" and ins[1].const)


def moves_a_leaf(site: Site, ins: list[Val]) -> bool:
    """A reshape, slice, size-1 broadcast, narrowing cast or constant-index lookup of
    a param (other operands: indices)."""
    head = ins[0] if ins else None
    if not keeps_leaf(site, ins) or head.kind in (Kind.KEEP, Kind.NEUTRAL):
        return False
    if any(v.managed for v in ins[1:]):
        return False
    if site.name == "convert_element_type":
        dst = np.dtype(site.eqn.params["new_dtype"])
        return is_policy_float(dst) and dst.itemsize <= head.dtype.itemsize
    if site.name == "broadcast_in_dim":  # one that repeats the param sums its gradient: a reduction, not a move
        return np.size(head.array) == int(np.prod(site.eqn.params["shape"]))
    return True
