"""A traced program as a flat list of operations on numbered values, and its evaluation.

:func:`flatten` turns a closed jaxpr into :class:`Program`: every value a number,
nested ``jit`` calls inlined (the same computation, one level), so that a loss
written through helpers (``optax``'s, ``jnp.take_along_axis``) reads as one list
the region finder can walk (:mod:`.region`). :func:`inline_custom_jvp` inlines a
``custom_jvp`` call's primal computation where a region needs to see inside it.
:func:`run` evaluates operations in an environment of values, as ``jax.core.eval_jaxpr``
does, with each operation's name stack kept (explain and the profiles name modules
by it).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal

__all__ = ["Op", "Program", "flatten", "inline_custom_jvp", "run"]

#: Calls whose body is the same computation inlined (nested jit).
_INLINED = ("pjit", "jit", "closed_call", "core_call")


class Op(NamedTuple):
    """One operation: its equation (primitive, params, name stack), operand value numbers
    (or a :class:`Literal`), and result value numbers."""

    eqn: Any
    ins: tuple
    outs: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.eqn.primitive.name

    @property
    def params(self) -> dict:
        return self.eqn.params


class Program(NamedTuple):
    """A flat program: input and constant value numbers, operations, outputs, and each value's aval."""

    inputs: tuple[int, ...]
    consts: dict[int, Any]
    ops: list[Op]
    outputs: tuple  # value numbers or Literals
    avals: dict[int, Any]


def flatten(closed: ClosedJaxpr) -> Program:
    """``closed`` as a :class:`Program`, nested jit calls inlined."""
    counter = itertools.count()
    avals: dict[int, Any] = {}
    jaxpr = closed.jaxpr
    names = {v: _fresh(v, counter, avals) for v in (*jaxpr.constvars, *jaxpr.invars)}
    consts = {names[v]: c for v, c in zip(jaxpr.constvars, closed.consts)}
    ops: list[Op] = []
    _inline(jaxpr, names, ops, counter, avals)
    outputs = tuple(_ref(names, v) for v in jaxpr.outvars)
    return Program(tuple(names[v] for v in jaxpr.invars), consts, ops, outputs, avals)


def inline_custom_jvp(program: Program, which: Iterable[int]) -> Program:
    """``program`` with the custom_jvp calls at op indices ``which`` replaced by their primal
    computation (its derivative then the one of the ops it computes with)."""
    which = set(which)
    counter = itertools.count(max(program.avals, default=-1) + 1)
    avals = dict(program.avals)
    ops: list[Op] = []
    for i, op in enumerate(program.ops):
        if i not in which:
            ops.append(op)
            continue
        call: ClosedJaxpr = op.params["call_jaxpr"]
        names = {v: _fresh(v, counter, avals) for v in call.jaxpr.constvars}
        consts = {names[v]: c for v, c in zip(call.jaxpr.constvars, call.consts)}
        names.update(zip(call.jaxpr.invars, op.ins))
        inner: list[Op] = []
        _inline(call.jaxpr, names, inner, counter, avals)
        ops.extend(_with_consts(inner, consts))
        for out, var in zip(op.outs, call.jaxpr.outvars):
            ops.append(_alias(out, _ref(names, var)))
    return program._replace(ops=ops, avals=avals)


def run(ops: Iterable[Op], env: dict, bind: Callable[[Op, list], list] | None = None) -> None:
    """Evaluates ``ops`` in order, reading operands from ``env`` and writing results there;
    ``bind(op, operands)`` (default: the op's primitive as traced) computes one op."""
    bind = bind or bind_as_traced
    for op in ops:
        args = [read(env, x) for x in op.ins]
        name_stack = source_info_util.current_name_stack() + op.eqn.source_info.name_stack
        with source_info_util.user_context(op.eqn.source_info.traceback, name_stack=name_stack):
            results = bind(op, args)
        env.update(zip(op.outs, results))


def read(env: dict, x: Any) -> Any:
    """A value: from ``env`` by number, or a literal's own."""
    return x.val if isinstance(x, Literal) else env[x]


def bind_as_traced(op: Op, args: list, **param_updates: Any) -> list:
    """The op's primitive bound on ``args`` (params updated), as a list of results."""
    if op.name == "_alias":
        return [args[0]]
    if op.name == "_const":
        return [op.params["value"]]
    params = op.eqn.primitive.get_bind_params({**op.params, **param_updates})
    with op.eqn.ctx.manager:
        results = op.eqn.primitive.bind(*args, **params)
    return list(results) if op.eqn.primitive.multiple_results else [results]


def _inline(jaxpr: Jaxpr, names: dict, ops: list[Op], counter: Any, avals: dict) -> None:
    for eqn in jaxpr.eqns:
        ins = tuple(_ref(names, v) for v in eqn.invars)
        if eqn.primitive.name in _INLINED and _callee(eqn) is not None:
            call = _callee(eqn)
            inner = {v: _fresh(v, counter, avals) for v in call.jaxpr.constvars}
            consts = {inner[v]: c for v, c in zip(call.jaxpr.constvars, call.consts)}
            inner.update(zip(call.jaxpr.invars, ins))
            body: list[Op] = []
            _inline(call.jaxpr, inner, body, counter, avals)
            ops.extend(_with_consts(body, consts))
            for var, result in zip(eqn.outvars, call.jaxpr.outvars):
                names[var] = _fresh(var, counter, avals)
                ops.append(_alias(names[var], _ref(inner, result), eqn))
            continue
        outs = tuple(_fresh(v, counter, avals) for v in eqn.outvars)
        names.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, DropVar))
        ops.append(Op(eqn, ins, outs))


def _callee(eqn: Any) -> ClosedJaxpr | None:
    """The program a call runs, with its constants. A closed one first: from jax 0.11 a
    ``Jaxpr`` is also a ``ClosedJaxpr`` holding its own constants, which ``ClosedJaxpr(call, ())``
    would turn into inputs (a program closing over an array, an nf4 weight's read, then failed)."""
    call = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(call, ClosedJaxpr):
        return call
    return ClosedJaxpr(call, ()) if isinstance(call, Jaxpr) else None


class _Pseudo(NamedTuple):
    """An equation of the flat program's own: a value renamed, or a constant."""

    primitive: Any
    params: dict
    source_info: Any
    ctx: Any = None


class _PseudoPrimitive(NamedTuple):
    name: str
    multiple_results: bool = False


def _alias(out: int, source: Any, like: Any = None) -> Op:
    info = like.source_info if like is not None else source_info_util.new_source_info()
    return Op(_Pseudo(_PseudoPrimitive("_alias"), {}, info), (source,), (out,))


def _with_consts(body: list[Op], consts: dict[int, Any]) -> list[Op]:
    info = source_info_util.new_source_info()
    return [Op(_Pseudo(_PseudoPrimitive("_const"), {"value": c}, info), (), (n,)) for n, c in consts.items()] + body


def _fresh(var: Any, counter: Any, avals: dict) -> int:
    n = next(counter)
    avals[n] = var.aval
    return n


def _ref(names: dict, var: Any) -> Any:
    return var if isinstance(var, Literal) else names[var]


def nbytes(aval: Any) -> int:
    """Bytes of an array of ``aval``."""
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
