"""A traced program as one flat list of ops (cut into segments by
:mod:`precision.doctor.segments`).

:func:`flatten` inlines what the probe looks inside (jit, pjit, remat,
custom_jvp/vjp calls, the branch of a ``jax.lax.platform_dependent`` choice this
machine runs) and numbers every value; a ``scan`` stays one step holding its body,
flattened too, so a scanned stack of layers is probed once per body with
statistics per iteration.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend.core import DropVar, Literal

from precision.autocast.program import binders, host_platform, platform_branch
from precision.autocast.regions import scope_names
from precision.doctor.measure import HALF, MATMULS

__all__ = ["Step", "Flat", "flatten", "primal_eqns", "reads"]

_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
           "custom_vjp_call": "call_jaxpr"}


class Step(NamedTuple):
    """One op of the flat program: its inputs and outputs as value numbers (an input
    may be a ``Literal``; an output ``None`` when dropped)."""

    eqn: Any
    ins: tuple
    outs: tuple
    scope: tuple[str, ...]
    backward: bool
    narrowed: bool  # a convert_element_type of a matmul's float32 result
    static: bool  # computed from literals only (XLA could fold it)
    body: Flat | None = None  # a scan's body
    matmul: str = ""  # a cast to half of a matmul's float32 result or of an operand it reads: that matmul's primitive


class Flat(NamedTuple):
    """A flat program: its steps, the numbers of its inputs and its outputs (numbers or literals)."""

    steps: tuple[Step, ...]
    inputs: tuple[int, ...]
    outputs: tuple


class _Flattener:
    def __init__(self):
        self.count = 0
        self.constants: dict[int, Any] = {}  # numbers of sub-programs' constants -> their values
        self.matmul_made: dict[int, str] = {}  # value number -> the matmul primitive that made it
        self.half_casts: dict[int, tuple[list, int]] = {}  # value number -> (steps, index) of the cast to half it is
        self.static: set[int] = set()
        self.steps: list[Step] = []

    def new(self) -> int:
        self.count += 1
        return self.count

    def constant_numbers(self, closed: Any) -> tuple[Any, list[int]]:
        jaxpr, consts = (closed.jaxpr, closed.consts) if hasattr(closed, "consts") else (closed, ())
        numbers = [self.new() for _ in consts]
        self.constants.update(zip(numbers, consts))
        return jaxpr, numbers

    def walk(self, jaxpr: Any, ins: Sequence[Any], prefix: tuple, backward: bool,
             primal: set[int] | None = None) -> list:
        env = dict(zip(binders(jaxpr), ins, strict=True))

        def read(v):
            return v if isinstance(v, Literal) else env[v]

        for index, eqn in enumerate(jaxpr.eqns):
            stack = getattr(eqn.source_info.name_stack, "stack", ())
            scope = prefix + scope_names(eqn.source_info.name_stack)
            is_backward = (backward or (primal is not None and index not in primal)
                           or any(type(e).__name__ == "Transform" and e.name == "transpose" for e in stack))
            outs = self.eqn(eqn, [read(v) for v in eqn.invars], scope, is_backward)
            for var, out in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, DropVar):
                    env[var] = out
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn: Any, ins: list, scope: tuple, backward: bool) -> list:
        name = eqn.primitive.name
        if name in _INLINE and _INLINE[name] in eqn.params:
            jaxpr, numbers = self.constant_numbers(eqn.params[_INLINE[name]])
            return self.walk(jaxpr, [*numbers, *ins], scope, backward)
        branch = platform_branch(eqn, host_platform())
        if branch is not None:  # jax.lax.platform_dependent: the branch this machine runs
            jaxpr, numbers = self.constant_numbers(eqn.params["branches"][branch])
            return self.walk(jaxpr, [*numbers, *ins[1:]], scope, backward)
        body = None
        if name == "scan" and int(eqn.params["length"]) > 0:
            jaxpr, numbers = self.constant_numbers(eqn.params["jaxpr"])
            outer, self.steps = self.steps, []
            inputs = [self.new() for _ in jaxpr.invars]
            outputs = self.walk(jaxpr, [*numbers, *inputs], scope, backward)
            body, self.steps = Flat(tuple(self.steps), tuple(inputs), tuple(outputs)), outer
        outs = tuple(None if isinstance(v, DropVar) else self.new() for v in eqn.outvars)
        numbered = [x for x in ins if not isinstance(x, Literal)]
        static = all(x in self.static for x in numbered) and body is None
        if static:
            self.static.update(o for o in outs if o is not None)
        narrowed = name == "convert_element_type" and bool(numbered) and numbered[0] in self.matmul_made
        matmul = self.matmul_made[numbered[0]] if narrowed else ""
        if name in MATMULS:
            self.matmul_made.update((o, name) for o in outs if o is not None)
            self._operands_of(name, numbered)
        if name == "convert_element_type" and not narrowed and _narrows(eqn) and outs[0] is not None:
            self.half_casts[outs[0]] = (self.steps, len(self.steps))
        elif name in _SAME_VALUES and numbered and numbered[0] in self.half_casts and outs[0] is not None:
            self.half_casts[outs[0]] = self.half_casts[numbered[0]]  # the cast, reshaped on its way to a matmul
        self.steps.append(Step(eqn, tuple(ins), outs, scope, backward, narrowed, static, body, matmul))
        return list(outs)

    def _operands_of(self, matmul: str, numbered: list) -> None:
        """Marks the casts to half that ``matmul`` reads (a param or activation rounded for it)."""
        for x in numbered:
            if x in self.half_casts:
                steps, index = self.half_casts[x]
                if not steps[index].matmul:
                    steps[index] = steps[index]._replace(matmul=matmul)


#: Ops that pass a value on unchanged in its values (a cast reshaped on its way to a matmul).
_SAME_VALUES = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "copy"})


def _narrows(eqn: Any) -> bool:
    """A cast from a wider float type to float16 or bfloat16."""
    source, target = eqn.invars[0].aval, eqn.outvars[0].aval
    return (hasattr(source, "dtype") and jnp.issubdtype(source.dtype, jnp.floating)
            and np.dtype(target.dtype) in HALF and np.dtype(source.dtype).itemsize > np.dtype(target.dtype).itemsize)


def flatten(closed: Any, primal: set[int] | None = None) -> tuple[Flat, dict[int, Any]]:
    """``closed`` (a ClosedJaxpr) as a flat program, and the values of the constants it
    numbered (the program's own constants come first among its inputs)."""
    flattener = _Flattener()
    jaxpr = closed.jaxpr
    inputs = [flattener.new() for _ in binders(jaxpr)]
    flattener.constants.update(zip(inputs, closed.consts))
    outputs = flattener.walk(jaxpr, inputs, (), False, primal)
    return Flat(tuple(flattener.steps), tuple(inputs[len(closed.consts):]), tuple(outputs)), flattener.constants


def reads(step: Step) -> Iterator[int]:
    """The value numbers ``step`` reads from outside it (a scan's body's outer values included)."""
    yield from (x for x in step.ins if not isinstance(x, Literal))
    if step.body is not None:
        inner = set(step.body.inputs) | {o for s in step.body.steps for o in s.outs if o is not None}
        for s in step.body.steps:
            yield from (x for x in reads(s) if x not in inner)
        yield from (x for x in step.body.outputs if not isinstance(x, Literal) and x not in inner)


def primal_eqns(jaxpr: Any, n_primal: int) -> set[int]:
    """Indices of the equations the first ``n_primal`` outputs need. In a differentiated
    program, the others before the transposes compute derivatives (sqrt's ``0.5 / y``):
    backward work, even where JAX places it in the forward pass."""
    needed = {v for v in jaxpr.outvars[:n_primal] if not isinstance(v, Literal)}
    found = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(v in needed for v in eqn.outvars if not isinstance(v, DropVar)):
            found.add(i)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    return found
