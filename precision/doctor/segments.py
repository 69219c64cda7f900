"""The flat program (:mod:`precision.doctor.flat`) cut into segments the doctor
compiles once and runs many times.

:func:`plan` cuts the ops where the module they belong to changes layer
(``block_3``, ``h/3``, ``layers/3``...): the forward and the backward pass of each
layer of an unrolled stack become segments of identical structure, and their key
(the segment written with its values renumbered in order of appearance, its ops'
parameters and types) lets one compiled program serve all of them. Runs of
segments that occur once (the embedding, the head and the loss, a model without
layers) are joined: a compiled program costs a fixed time, repeated or not.
"""

from __future__ import annotations

import enum
import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from precision.autocast.program import binders
from precision.autocast.regions import module_path
from precision.doctor.flat import Flat, Step, reads

__all__ = ["Segment", "plan"]


class Segment(NamedTuple):
    """Steps run as one compiled program: the values they read and those read after them."""

    steps: tuple[Step, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    last_reads: frozenset[int]  # inputs no later segment reads (dropped after it)
    key: tuple


def _layer(step: Step) -> tuple[str, ...]:
    """The module path of ``step`` up to its first name that numbers a layer (``block_3``,
    ``h/3``), else its first name; () outside modules."""
    path = module_path(step.scope)
    for i, name in enumerate(path):
        if name[-1:].isdigit():
            return path[:i + 1]
    return path[:1]


def _cut(steps: Sequence[Step]) -> list[list[Step]]:
    """``steps`` cut where the layer changes (steps outside modules join the segment before them)."""
    cut: list[list[Step]] = []
    current: tuple | None = None
    for step in steps:
        layer = _layer(step)
        if not cut or (layer and layer != current):
            cut.append([])
            current = layer or current
        cut[-1].append(step)
    return cut


# ----------------------------------------------------------------------------- keys


def _array_key(x: Any) -> tuple:
    value = np.asarray(x)
    return ("array", value.shape, str(value.dtype), hashlib.blake2b(value.tobytes(), digest_size=16).hexdigest())


def _aval_key(aval: Any) -> tuple:
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", type(aval).__name__)),
            bool(getattr(aval, "weak_type", False)), str(getattr(aval, "sharding", "")))


def _value_key(v: Any) -> Any:
    """A key of an op parameter: equal keys, equal parameters (an object known by its
    identity only is keyed by it)."""
    if isinstance(v, ClosedJaxpr):
        return ("closed", _jaxpr_key(v.jaxpr), tuple(_array_key(c) for c in v.consts))
    if isinstance(v, Jaxpr):
        return ("jaxpr", _jaxpr_key(v))
    if isinstance(v, (np.ndarray, jax.Array)):
        return _array_key(v)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((str(k), _value_key(x)) for k, x in v.items())))
    if v is None or isinstance(v, (str, int, float, bool, np.dtype, np.generic, enum.Enum, type)):
        return (type(v).__name__, repr(v))
    text = repr(v)
    return ("id", id(v)) if callable(v) or " at 0x" in text else (type(v).__name__, text)


def _jaxpr_key(jaxpr: Any) -> tuple:
    numbers: dict[Any, int] = {}
    for v in binders(jaxpr):
        numbers[v] = len(numbers)

    def ref(v):
        return ("lit", repr(v.val), _aval_key(v.aval)) if isinstance(v, Literal) else numbers[v]

    eqns = []
    for eqn in jaxpr.eqns:
        ins = tuple(ref(v) for v in eqn.invars)
        for v in eqn.outvars:
            numbers[v] = len(numbers)
        eqns.append((eqn.primitive.name, _value_key(eqn.params), ins, tuple(_aval_key(v.aval) for v in eqn.outvars),
                     _context_key(eqn)))
    return (tuple(_aval_key(v.aval) for v in binders(jaxpr)), tuple(eqns), tuple(ref(v) for v in jaxpr.outvars))


def _context_key(eqn: Any) -> str:
    text = repr(getattr(eqn, "ctx", None))
    return str(id(eqn.ctx)) if " at 0x" in text else text


def _steps_key(steps: Sequence[Step], numbers: dict[int, int], outputs: Sequence[Any]) -> tuple:
    def ref(x, aval):
        if isinstance(x, Literal):
            return ("lit", repr(x.val), _aval_key(x.aval))
        if x not in numbers:
            numbers[x] = len(numbers)
        return (numbers[x], _aval_key(aval))

    key = []
    for step in steps:
        eqn = step.eqn
        params = eqn.params if step.body is None else {k: v for k, v in eqn.params.items() if k != "jaxpr"}
        ins = tuple(ref(x, v.aval) for x, v in zip(step.ins, eqn.invars))
        body = None
        if step.body is not None:
            for x in step.body.inputs:
                numbers[x] = len(numbers)
            body = _steps_key(step.body.steps, numbers, step.body.outputs)
        for o in step.outs:
            if o is not None:
                numbers[o] = len(numbers)
        key.append((eqn.primitive.name, _value_key(params), ins, tuple(_aval_key(v.aval) for v in eqn.outvars),
                    tuple(o is None for o in step.outs), step.backward, step.narrowed, step.matmul,
                    step.static, _context_key(eqn), body))
    return (tuple(key), tuple(ref(x, None) if isinstance(x, Literal) else numbers.get(x, -1) for x in outputs))


def _key(steps: Sequence[Step], inputs: Sequence[int], outputs: Sequence[int], extra: Any) -> tuple:
    """A key equal for segments that compute the same thing from inputs of the same
    types (their values renumbered in order of appearance); ``extra``: what else the
    compiled program depends on."""
    numbers = {x: i for i, x in enumerate(inputs)}
    return (_steps_key(steps, numbers, outputs), len(inputs), extra)


def _segments(parts: list[list[Step]], program: Flat, extra: Any) -> list[Segment]:
    last: dict[int, int] = {}
    for k, part in enumerate(parts):
        for step in part:
            last.update((x, k) for x in reads(step))
    final = {x for x in program.outputs if not isinstance(x, Literal)}
    found = []
    for k, part in enumerate(parts):
        defined = {o for step in part for o in step.outs if o is not None}
        inputs = tuple(dict.fromkeys(x for step in part for x in reads(step) if x not in defined))
        outputs = tuple(o for step in part for o in step.outs
                        if o is not None and (last.get(o, -1) > k or o in final))
        dropped = frozenset(x for x in inputs if last.get(x) == k and x not in final)
        found.append(Segment(tuple(part), inputs, outputs, dropped, _key(part, inputs, outputs, extra)))
    return found


def plan(program: Flat, extra: Any) -> list[Segment]:
    """``program``'s steps as segments, in order: one per layer and pass where layers
    repeat, runs of segments that occur once joined. ``extra``: what else the compiled
    programs depend on (part of their keys)."""
    cut = _segments(_cut(program.steps), program, extra)
    counts = Counter(s.key for s in cut)
    joined: list[list[Step]] = []
    for i, segment in enumerate(cut):
        alone = counts[segment.key] == 1
        if joined and alone and i and counts[cut[i - 1].key] == 1:
            joined[-1] += segment.steps
        else:
            joined.append(list(segment.steps))
    return cut if len(joined) == len(cut) else _segments(joined, program, extra)
