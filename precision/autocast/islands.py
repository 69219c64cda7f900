"""Float32 islands, planned before anything is bound: which values of a program
every use of which computes in float32.

A deny-listed op (``exp``, ``rsqrt``, ``reduce_sum``...) computes in float32,
and so should the elementwise ops whose results only feed it: the ``x - max``
of a softmax, the ``x * x`` of a variance. :func:`demanded_vars` walks a
program backwards to find them, from the kind each value will have
(:func:`static_kinds`, walked forwards). The interpreter then computes those
ops in float32; a value also used by half ops stays half.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np
from jax.extend.core import DropVar, Literal

from precision.autocast.op_lists import OpClass, OpLists
from precision.autocast.program import binders
from precision.autocast.regions import module_path, scope_names, within
from precision.autocast.values import Kind, is_policy_float

__all__ = ["static_kinds", "demanded_vars"]


def static_kinds(jaxpr: Any, in_kinds: Sequence[Kind], prefix: tuple[str, ...], ops: OpLists) -> tuple[dict, dict]:
    """The kind each variable will have, worked out without binding anything
    (sub-programs count as half): (kinds, module path of each producer)."""
    kinds: dict[Any, Kind] = dict(zip(binders(jaxpr), in_kinds))
    paths: dict[Any, tuple[str, ...]] = {v: module_path(prefix) for v in kinds}
    for eqn in jaxpr.eqns:
        path = module_path(prefix + scope_names(eqn.source_info.name_stack))
        ins = []
        for v in eqn.invars:
            kind = Kind.NEUTRAL if isinstance(v, Literal) else kinds[v]
            if kind is Kind.FULL and not isinstance(v, Literal) and not within(path, paths[v]):
                kind = Kind.HALF
            ins.append(kind)
        outs = [v for v in eqn.outvars if not isinstance(v, DropVar)]
        for v, kind in zip(outs, _out_kinds(eqn, ins, len(outs), ops)):
            kinds[v] = kind if is_policy_float(v.aval.dtype) else Kind.KEEP
            paths[v] = path
    return kinds, paths


def _out_kinds(eqn: Any, ins: list[Kind], n_out: int, ops: OpLists) -> list[Kind]:
    """The kinds of an equation's outputs from the kinds of its inputs."""
    managed = [k for k in ins if k is not Kind.KEEP]
    name, cls = eqn.primitive.name, ops.classify(eqn.primitive.name)
    if all(k is Kind.NEUTRAL for k in managed):
        return [Kind.NEUTRAL] * n_out
    if cls is OpClass.EACH and n_out == len(ins):
        return ins
    if name == "convert_element_type":
        src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.params["new_dtype"])
        upcast = is_policy_float(src) and is_policy_float(dst) and dst.itemsize > src.itemsize
        return [Kind.FULL if upcast else ins[0] if src == dst else Kind.HALF]
    full = cls is OpClass.DENY or (cls is OpClass.FOLLOW and Kind.FULL in managed)
    return [Kind.FULL if full else Kind.HALF] * n_out


def demanded_vars(jaxpr: Any, in_kinds: Sequence[Kind], prefix: tuple[str, ...], ops: OpLists) -> set:
    """Floating variables every use of which computes in float32.

    Walks the equations backwards: a deny-listed op demands float32 operands,
    and so does a follow op (or a convert) that computes in float32: because
    its own outputs are demanded, or because another operand is a float32
    island. So ``reduce_sum(x * x)`` squares in float32, ``x - max`` of a
    softmax subtracts in float32, while ``x``, also used by half ops, stays half.
    Demand stays inside the module that consumes: a norm does not make the
    module feeding it compute in float32.
    """
    kinds, paths = static_kinds(jaxpr, in_kinds, prefix, ops)
    uses: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        uses.update(v for v in eqn.invars if not isinstance(v, Literal))
    uses.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
    demand: collections.Counter = collections.Counter()
    demanded: set = set()
    for eqn in reversed(jaxpr.eqns):
        outs = [v for v in eqn.outvars if not isinstance(v, DropVar) and is_policy_float(v.aval.dtype)]
        all_demanded = bool(outs) and all(uses[v] and demand[v] == uses[v] for v in outs)
        if all_demanded:
            demanded.update(outs)
        name = eqn.primitive.name
        cls = ops.classify(name)
        floats = [v for v in eqn.invars if not isinstance(v, Literal) and is_policy_float(v.aval.dtype)]
        path = module_path(prefix + scope_names(eqn.source_info.name_stack))
        if cls is OpClass.FOLLOW or name == "convert_element_type":
            island = any(kinds[v] is Kind.FULL and within(path, paths[v]) for v in floats)
            demanding = all_demanded or island
        else:
            demanding = cls is OpClass.DENY
        if demanding:  # within a module: a module's inputs are not computed in float32 for it
            demand.update(v for v in floats if within(path, paths[v]))
    return demanded
