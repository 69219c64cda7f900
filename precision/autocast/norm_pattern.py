"""Layer, RMS and batch normalization written out, found in a traced program.

Flax's ``LayerNorm``, ``RMSNorm`` and ``BatchNorm`` (Linen and NNX), Hugging Face-style and
hand-written norms all trace to a few dozen elementwise ops around two row
reductions. :func:`find_norms` recognises them, whatever the layout:

    mean  = sum(x, axes) / n                       (centred norms only)
    var   = sum(x*x, axes) / n - mean**2           (maybe max(0, .)),
          | sum((x - mean)**2, axes) / n           (two passes),
          | sum(x*x, axes) / n                     (RMS: no mean)
    rstd  = rsqrt(var + eps)                       (through keepdims reshapes)
    y     = (x - mean) * rstd * scale + offset     (any order of the products;
                                                    scale and offset optional)

and describes it as one :class:`Norm`. It is the same computation only where
nothing else reads its inside (the centred values, the normalised ones...) but its
statistics, which a BatchNorm in training also averages into its running ones
(``stats_out``: given out beside the result), and where ``scale`` and ``offset``
are not computed from ``x``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any

from jax.extend.core import Literal

from precision.autocast.attention_masks import Graph, constant, prim

__all__ = ["Norm", "find_norms", "survey", "describe"]

_KEEPDIMS = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims")


@dataclasses.dataclass(frozen=True)
class Norm:
    """One normalization among a program's equations."""

    eqns: frozenset[int]  # the equations it replaces
    last: int  # where its result is made
    x: Any  # the var normalised
    axes: tuple[int, ...]  # x's normalised axes
    mean: Any  # the var of the mean (its reduced shape), None for an RMS norm
    rstd: Any  # the var of rsqrt(var + eps)
    scale: Any  # the var multiplied in, or None
    offset: Any  # the var added, or None
    out: Any
    variance: Any = None  # the var of the variance (before eps)
    stats_out: tuple[Any, ...] = ()  # the mean and/or variance vars read outside it (BatchNorm's running averages)
    eps: float = 0.0  # added to the variance before rsqrt


def describe(norm: Norm) -> str:
    """A norm's kind and axes, as explain says it."""
    last = len(norm.x.aval.shape) - 1
    kind = "RMS norm" if norm.mean is None else "layer norm" if last in norm.axes else "batch norm"
    axes = ", ".join(str(a - len(norm.x.aval.shape)) for a in norm.axes)
    parts = [p for p, v in (("scale", norm.scale), ("offset", norm.offset)) if v is not None]
    return f"{kind} over axis {axes}" + (f" with {' and '.join(parts)}" if parts else "")


def find_norms(jaxpr: Any, consts: dict | None = None) -> list[Norm]:
    """Every layer, RMS or batch normalization of ``jaxpr`` (its own equations, not sub-programs)."""
    return survey(jaxpr, consts)[0]


def survey(jaxpr: Any, consts: dict | None = None) -> tuple[list[Norm], list[tuple[int, str]]]:
    """The norms of ``jaxpr`` (:func:`find_norms`), and (``rsqrt`` equation index, why) for each
    normalization whose statistics are there but which is not one to take whole (its centred
    values read elsewhere...): what explain says was left as written."""
    graph = Graph(jaxpr, consts)
    found, missed, taken = [], [], set()
    for i, eqn in enumerate(jaxpr.eqns):
        if prim(eqn) == "rsqrt":
            norm = _match_at(graph, i)
            if isinstance(norm, str):
                missed.append((i, norm))
            elif norm is not None and not norm.eqns & taken:
                found.append(norm)
                taken |= norm.eqns
    return found, missed


#: Why a normalization (statistics found) is not taken whole, as explain says it.
READ_INSIDE = "its centred or normalized values are read outside it"
SHAPE = "its result's shape is not its input's"
OTHER_INPUT = "it reads a value other than its input, scale, offset and constants"


def _match_at(graph: Graph, rsqrt: int) -> Norm | str | None:
    """The norm whose ``rsqrt`` is equation ``rsqrt``; why not, where its statistics are
    there but the rest is not a norm to take whole; None where there are no statistics."""
    group: set[int] = {rsqrt}
    var, eps = _added_eps(graph, graph.jaxpr.eqns[rsqrt].invars[0], group)
    stats = _variance(graph, var, group) if var is not None else None
    if stats is None:
        return None
    x, axes, mean, centred = stats
    variance = var
    rstd = graph.jaxpr.eqns[rsqrt].outvars[0]
    forward = _normalized(graph, x, mean, rstd, group, centred)
    if isinstance(forward, str):
        return forward
    out, scale, offset = forward
    if out.aval.shape != x.aval.shape:
        return SHAPE
    inputs = {x, scale, offset} - {None}
    stats_out = []
    for i in sorted(group):
        eqn = graph.jaxpr.eqns[i]
        for v in eqn.outvars:
            if v is not out and not graph.only_used_by(v, group):
                if not any(v is s for s in (mean, variance)):
                    return READ_INSIDE
                stats_out.append(v)
        for v in eqn.invars:
            if not (isinstance(v, Literal) or v in inputs or graph.producer.get(v) in group or _concrete(graph, v)):
                return OTHER_INPUT
    return Norm(frozenset(group), max(group), x, axes, mean, rstd, scale, offset, out, variance, tuple(stats_out), eps)


def _concrete(graph: Graph, var: Any) -> bool:
    return var in graph.consts and constant(graph, var) is not None


def _strip(graph: Graph, var: Any, group: set[int]) -> Any:
    """``var`` before the reshapes and broadcasts that only add or drop size-1 dims."""
    while True:
        eqn = graph.eqn(var)
        if prim(eqn) not in _KEEPDIMS or math.prod(eqn.invars[0].aval.shape) != math.prod(var.aval.shape):
            return var
        group.add(graph.producer[var])
        var = eqn.invars[0]


def _filled(graph: Graph, var: Any) -> tuple[float | None, set[int]]:
    """The one value ``var`` holds where it is a literal (or a concrete constant) of size 1
    broadcast, reshaped or cast, and the equations doing that; (None, ...) otherwise. Walks
    only that chain: folding whatever computed a var would walk the whole program."""
    made: set[int] = set()
    while not isinstance(var, Literal) and var in graph.producer:
        eqn = graph.eqn(var)
        if prim(eqn) not in _KEEPDIMS + ("convert_element_type",):
            return None, made
        made.add(graph.producer[var])
        var = eqn.invars[0]
    value = constant(graph, var) if isinstance(var, Literal) or var in graph.consts else None
    return (float(value.reshape(())) if value is not None and value.size == 1 else None), made


def _scalar(graph: Graph, var: Any) -> float | None:
    """The value of a size-1 literal or constant (maybe reshaped or cast); None otherwise."""
    return _filled(graph, var)[0] if math.prod(getattr(var.aval, "shape", ())) == 1 else None


def _added_eps(graph: Graph, var: Any, group: set[int]) -> tuple[Any, float]:
    """``(variance, eps)`` in ``var = variance + eps`` (reshapes allowed on either side); (None, 0) if not."""
    var = _strip(graph, var, group)
    eqn = graph.eqn(var)
    if prim(eqn) != "add":
        return None, 0.0
    a, b = eqn.invars
    if _scalar(graph, b) is None:
        a, b = b, a
    eps = _scalar(graph, b)
    if eps is None or eps < 0:
        return None, 0.0
    group.add(graph.producer[var])
    return _strip(graph, a, group), eps


def _mean(graph: Graph, var: Any, group: set[int]) -> tuple[Any, tuple[int, ...]] | None:
    """``(z, axes)`` where ``var = sum(z, axes) / n``, n the reduced size."""
    eqn = graph.eqn(var)
    if prim(eqn) not in ("div", "mul"):
        return None
    total, n = eqn.invars
    n_value = _scalar(graph, n)
    if n_value is None and prim(eqn) == "mul":
        total, n = n, total
        n_value = _scalar(graph, n)
    reshaped: set[int] = set()
    summed = graph.eqn(_strip(graph, total, reshaped)) if not isinstance(total, Literal) else None
    if n_value is None or prim(summed) != "reduce_sum" or not n_value:
        return None
    z, axes = summed.invars[0], tuple(summed.params["axes"])
    size = math.prod(z.aval.shape[a] for a in axes)
    if not math.isclose(n_value if prim(eqn) == "div" else 1 / n_value, size, rel_tol=1e-6):
        return None
    group.update(reshaped | {graph.producer[var], _index(graph, summed)})
    return z, axes


def _index(graph: Graph, eqn: Any) -> int:
    return graph.producer[eqn.outvars[0]]


def _square(graph: Graph, var: Any, group: set[int]) -> Any:
    """``z`` where ``var = z**2`` (square, integer_pow 2, or z * z)."""
    eqn = graph.eqn(var)
    name = prim(eqn)
    if name == "square" or (name == "integer_pow" and eqn.params.get("y") == 2) or (
            name == "mul" and eqn.invars[0] is eqn.invars[1]):
        group.add(graph.producer[var])
        return eqn.invars[0]
    return None


def _variance(graph: Graph, var: Any, group: set[int]) -> tuple[Any, tuple[int, ...], Any, Any] | None:
    """``(x, axes, mean var or None, centred var or None)`` of a variance: E[x²] - E[x]²,
    E[(x - E[x])²] (its ``x - E[x]`` the centred var, which the normalization may read too)
    or E[x²]."""
    eqn = graph.eqn(var)
    if prim(eqn) == "max" and any(_scalar(graph, v) == 0.0 for v in eqn.invars):
        group.add(graph.producer[var])
        var = next(v for v in eqn.invars if _scalar(graph, v) != 0.0)
        eqn = graph.eqn(var)
    if prim(eqn) == "sub":  # one pass: E[x²] - E[x]²
        second, first_sq = eqn.invars
        m2, mean_sq = _mean(graph, second, group), _square(graph, first_sq, group)
        x = _square(graph, m2[0], group) if m2 else None
        m1 = _mean(graph, mean_sq, group) if mean_sq is not None else None
        if x is None or m1 is None or m1[0] is not x or m1[1] != m2[1]:
            return None
        group.add(graph.producer[var])
        return x, m2[1], mean_sq, None
    moment = _mean(graph, var, group)
    z = _square(graph, moment[0], group) if moment else None
    if z is None:
        return None
    centred, tried = graph.eqn(z), set()
    if prim(centred) == "sub":  # two passes: E[(x - E[x])²]
        x, m = centred.invars
        m = _strip(graph, m, tried)
        m1 = _mean(graph, m, tried)
        if m1 is not None and m1[0] is x and m1[1] == moment[1]:
            group |= tried | {graph.producer[z]}
            return x, moment[1], m, z
        tried = set()
        if _zeros(graph, _strip(graph, m, tried), tried):  # E[(x - 0)²]: an RMS norm
            group |= tried | {graph.producer[z]}
            return x, moment[1], None, z
    return z, moment[1], None, None


def _independent(graph: Graph, var: Any, x: Any, depth: int = 0) -> bool:
    """Whether ``var`` is computed without ``x`` (a param as a layer reads it)."""
    if var is x or depth > 16:
        return False
    eqn = graph.eqn(var)
    return eqn is None or all(isinstance(v, Literal) or _independent(graph, v, x, depth + 1) for v in eqn.invars)


def _normalized(graph: Graph, x: Any, mean: Any, rstd: Any, group: set[int],
                centred: Any = None) -> tuple[Any, Any, Any] | str:
    """``(out, scale, offset)``: the value ``(x - mean) * rstd * scale + offset`` is made in,
    following ``x``'s centred values (``centred``: those the variance was computed from, where
    the normalization reads them too) and ``rstd`` forward through the program; why not where
    there is no one such value."""
    # forms: var -> "C" (x centred), ("F", scales) (rstd times scales), ("Y", scales, offset)
    forms: dict[Any, Any] = {rstd: ("F", ())}
    if mean is None:
        forms[x] = "C"
    if centred is not None:
        forms[centred] = "C"
    made = set()
    start = min(group)
    todo = sorted({i for v in (x, rstd, centred) if v is not None for i in graph.uses.get(v, []) if i >= start})
    seen = set(todo)
    while todo:
        i = heapq.heappop(todo)
        eqn = graph.jaxpr.eqns[i]
        ins = [forms.get(v) if not isinstance(v, Literal) else None for v in eqn.invars]
        if i in group or (all(f is None for f in ins) and prim(eqn) != "sub"):
            continue
        form = _step(graph, eqn, ins, x, mean, group)
        if form is None:
            continue
        forms[eqn.outvars[0]] = form
        group.add(i)
        made.add(eqn.outvars[0])
        for j in graph.uses.get(eqn.outvars[0], []):
            if j not in seen:
                seen.add(j)
                heapq.heappush(todo, j)
    outs = [v for v in made if isinstance(forms[v], tuple) and forms[v][0] == "Y" and not graph.only_used_by(v, group)]
    if not outs:
        return "its normalized values are not made as (x - mean) * rstd * scale + offset"
    if len(outs) > 1:
        return READ_INSIDE
    _, scales, offset = forms[outs[0]]
    if len(scales) > 1:
        return "it multiplies its normalized values by more than one scale"
    return outs[0], (scales[0] if scales else None), offset


def _step(graph: Graph, eqn: Any, ins: list, x: Any, mean: Any, group: set[int]) -> Any:
    """The form of ``eqn``'s result, or None where it leaves the normalization."""
    name = prim(eqn)
    if name == "sub" and eqn.invars[0] is x:
        m = _strip(graph, eqn.invars[1], set())
        if mean is not None and m is mean:
            _strip(graph, eqn.invars[1], group)
            return "C"
        if mean is None and _zeros(graph, m, group):
            _strip(graph, eqn.invars[1], group)
            return "C"
        return None
    if name in _KEEPDIMS + ("convert_element_type",) and _is(ins[0], "F"):
        return ins[0]
    if name not in ("mul", "add") or all(f is None for f in ins):
        return None
    (fa, fb), (va, vb) = ins, eqn.invars
    if fa is None:
        fa, fb, va, vb = fb, fa, vb, va
    if fb is None and (isinstance(vb, Literal) or not _independent(graph, vb, x)):
        return None
    if name == "add":
        return ("Y", fa[1], vb) if _is(fa, "Y") and fa[2] is None and fb is None else None
    if fb is None:
        if _is(fa, "F"):
            return ("F", fa[1] + (vb,))
        return ("Y", fa[1] + (vb,), None) if _is(fa, "Y") and fa[2] is None else None
    if fa == "C" and _is(fb, "F"):
        return ("Y", fb[1], None)
    if _is(fa, "F") and fb == "C":
        return ("Y", fa[1], None)
    if _is(fa, "F") and _is(fb, "F"):
        return ("F", fa[1] + fb[1])
    return None


def _is(form: Any, kind: str) -> bool:
    return isinstance(form, tuple) and form[0] == kind


def _zeros(graph: Graph, var: Any, group: set[int]) -> bool:
    """Whether ``var`` is zeros made from a literal (an RMS norm's mean); its equations join ``group``."""
    value, made = _filled(graph, var)
    if value != 0.0:
        return False
    group |= made
    return True
