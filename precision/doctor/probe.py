"""Evaluating a traced program with a probe on every op: what each op computed,
read in float32 from the dtype it computed in (:mod:`precision.doctor.measure`).

The program is the one the policy runs (a model under :func:`precision.with_policy`
or :func:`precision.autocast`, differentiated by ``jax.value_and_grad``: forward
and backward in one jaxpr). :func:`run` flattens it (:mod:`precision.doctor.flat`:
jit, pjit, remat, custom_jvp/vjp calls and this machine's branch of a
``jax.lax.platform_dependent`` choice inlined), cuts it into segments, one per
layer and pass, and evaluates each segment again, equation by equation, inside
one ``jax.jit``, measuring every floating output an op computes (ops that only
move values are not probed: their inputs and consumers are). Segments of the
same structure (the layers of a stack, forward or backward) share one compiled
program; a ``scan`` runs as a scan, its body probed once with statistics per
iteration. Values are dropped after their last segment, so the probe holds about
what the program itself holds. ``while``, ``cond`` and ``shard_map`` run as they are,
probed as one op. The training step itself is never touched: this is a separate
program, run for a diagnosis.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import Literal

from precision.autocast.program import MOVES, host_platform
from precision.autocast.regions import module_path
from precision.doctor.flat import Step, flatten, primal_eqns
from precision.doctor.measure import (HALF, SCALES, flushed_at, half_matmul, pack, reduce_terms, shadow, terms,
                                      unpack)
from precision.doctor.segments import Segment, plan

__all__ = ["SCALES", "Probe", "run"]

F32 = np.dtype(np.float32)

#: Ops that only move, pick or copy values (no rounding, no new magnitude): not probed.
_MOVES_VALUES = MOVES | {"dynamic_update_slice", "concatenate", "select_n", "neg", "abs", "max", "min", "reduce_max",
                         "reduce_min", "stop_gradient", "pad", "gather", "optimization_barrier"}


class Probe(NamedTuple):
    """What was measured at one output of one op (the arrays come back from the device)."""

    index: int  # evaluation order: forward ops come before the backward ones
    path: tuple[str, ...]  # module path
    primitive: str
    backward: bool
    dtype: np.dtype
    size: int
    stats: dict  # name -> scalar (host values after the run)
    narrowed: str = ""  # a cast to half shown as the matmul it serves: of its float32 "result" or an "operand"


class _Template(NamedTuple):
    """A probe as the trace of a segment knows it; the step it measures is found by ``locator``
    (positions in the segment, then in scan bodies) in each segment the program serves."""

    locator: tuple[int, ...]
    shown: str
    dtype: np.dtype
    size: int
    narrowed: str
    inner: tuple | None = None  # a scan: its body's templates, (length, reverse)
    loop: tuple[int, bool] | None = None


@jax.jit
def finite_flags(values: list) -> list:
    """Per value, whether all of it is finite (non-floating values: True), in one program."""
    return [jnp.all(jnp.isfinite(v)) if jnp.issubdtype(v.dtype, jnp.floating) else jnp.array(True) for v in values]


def _is_float(aval: Any) -> bool:
    return hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating)


def _widening(eqn: Any) -> bool:
    """A cast to a wider float type: the value is kept exactly (its input is probed)."""
    if eqn.primitive.name != "convert_element_type" or not _is_float(eqn.invars[0].aval):
        return False
    source, target = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.outvars[0].aval.dtype)
    return jnp.issubdtype(target, jnp.floating) and target.itemsize > source.itemsize


#: Ops whose output is finite exactly when their (first) input is: finiteness passes through.
_SAME_VALUES = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "copy", "rev"})


class _Collector:
    """One traced evaluation of steps: the templates and statistics of the probes, and
    whether each value is finite (measured once per value). Measurements are reduced
    together when the collector is flushed (:func:`measure.reduce_terms`)."""

    def __init__(self, loss_scale: float, finite: dict | None = None):
        self.loss_scale = loss_scale
        self.templates: list[_Template] = []
        self.arrays: list[Any] = []
        self.finite: dict[Any, jax.Array] = dict(finite or {})
        self.same: dict[int, tuple[Any, Any]] = {}  # value number -> (number, value) it has the finiteness of
        self.pending: list[tuple[int, tuple, Any, list, int | None]] = []  # (probe, terms, sample, inputs, number)

    def flag(self, ref: Any, value: Any) -> jax.Array:
        """Whether every value of ``value`` (number or literal ``ref``) is finite."""
        while not isinstance(ref, Literal) and ref in self.same and ref not in self.finite:
            ref, value = self.same[ref]
        if isinstance(ref, Literal):
            value, ref = np.asarray(value), id(ref)
        if not (hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)):
            return jnp.array(True)
        if ref not in self.finite:
            self.finite[ref] = jnp.all(jnp.isfinite(value))
        return self.finite[ref]

    def execute(self, steps: Sequence[Step], env: dict, locator: tuple = ()) -> None:
        for position, step in enumerate(steps):
            ins = [x.val if isinstance(x, Literal) else env[x] for x in step.ins]
            outs = self.step(step, ins, env, (*locator, position))
            for number, out in zip(step.outs, outs, strict=True):
                if number is not None:
                    env[number] = out

    def flush(self) -> None:
        """Reduces the pending measurements; fills the probes' statistics and the values' finiteness."""
        pending, self.pending = self.pending, []
        reduced = reduce_terms([terms for _, terms, _, _, _ in pending])
        for (_, _, _, _, number), stats in zip(pending, reduced):
            if number is not None:
                self.finite[number] = stats["inf"] + stats["nan"] == 0
        for (probe, _, sample, inputs, _), stats in zip(pending, reduced):
            flags = [self.flag(ref, x) for ref, x in inputs]
            stats["inputs_finite"] = jnp.all(jnp.stack(flags)) if flags else jnp.array(True)
            if sample is not None:
                stats["sample"] = sample
            self.arrays[probe] = stats

    def step(self, step: Step, ins: list, env: dict, locator: tuple) -> list:
        eqn = step.eqn
        if step.body is not None:
            return self.scan(step, ins, env, locator)
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        shadows: dict[int, jax.Array] = {}
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            matmul = half_matmul(eqn, ins)
            if matmul is not None:
                outs, shadows = [matmul[0]], {0: matmul[1]}
            else:
                outs = eqn.primitive.bind(*ins, **eqn.params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
        name = eqn.primitive.name
        if (name in _SAME_VALUES or _widening(eqn)) and step.outs[0] is not None and step.ins:
            self.same[step.outs[0]] = (step.ins[0], ins[0])
        if name in _MOVES_VALUES or _widening(eqn):
            return outs
        inputs = [(ref, x) for ref, x, v in zip(step.ins, ins, eqn.invars) if _is_float(v.aval)]
        # A matmul's float32 result, or an operand, cast to half for it: the cast overflows, the matmul
        # is what the user wrote (a Dense, a Conv).
        shown = step.matmul or name
        narrowed = "result" if step.narrowed else "operand" if step.matmul else ""
        for i, (out, var) in enumerate(zip(outs, eqn.outvars)):
            dtype = np.dtype(var.aval.dtype) if _is_float(var.aval) else None
            if dtype not in (*HALF, F32) or not math.prod(var.aval.shape):
                continue
            ref = shadows.get(i, shadow(eqn, ins, i) if dtype in HALF else None)
            value = jax.lax.optimization_barrier(out) if step.static else out  # else XLA folds it at compile time
            counts, maxima, sample = terms(value, ref, step.backward, self.loss_scale)
            self.pending.append((len(self.arrays), (counts, maxima), sample, inputs, step.outs[i]))
            self.templates.append(_Template(locator, shown, dtype, int(math.prod(var.aval.shape)), narrowed))
            self.arrays.append(None)
        return outs

    def scan(self, step: Step, ins: list, env: dict, locator: tuple) -> list:
        """A scan run as a scan: its body probed, statistics stacked per iteration."""
        from precision.autocast.program import scan_counts

        self.flush()  # the body reads the finiteness of the values before it
        params, body = step.eqn.params, step.body
        n_consts, n_carry = scan_counts(params)
        consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        traced: list[_Collector] = []

        def iteration(c, x):
            inner = _Collector(self.loss_scale, self.finite)
            local = dict(env)
            local.update(zip(body.inputs, [*consts, *c, *x], strict=True))
            inner.execute(body.steps, local, locator)
            inner.flush()
            outs = [o.val if isinstance(o, Literal) else local[o] for o in body.outputs]
            traced.append(inner)
            return outs[:n_carry], (outs[n_carry:], inner.arrays)

        length, reverse = int(params["length"]), bool(params.get("reverse", False))
        carry, (ys, arrays) = jax.lax.scan(iteration, list(carry), list(xs), length=length, reverse=reverse)
        self.templates.append(_Template(locator, "scan", F32, 0, "", tuple(traced[-1].templates),
                                        (length, reverse)))
        self.arrays.append(arrays)
        return [*carry, *ys]


def _expand(templates: Sequence[_Template], arrays: Sequence[Any], steps: Sequence[Step]) -> list[tuple]:
    """(path, primitive, backward, dtype, size, narrowed, stats) of each probe of a segment run, in evaluation order."""
    found = []
    for t, stats in zip(templates, arrays):
        step = steps[t.locator[0]]
        for position in t.locator[1:]:
            step = step.body.steps[position]
        if t.inner is None:
            stats = {k: np.asarray(v) for k, v in stats.items()}
            if "sample" in stats:
                stats["flushed_at"] = flushed_at(stats.pop("sample"), int(stats["nonzero_ref"]))
            found.append((module_path(step.scope), t.shown, step.backward, t.dtype, t.size, t.narrowed, stats))
            continue
        length, reverse = t.loop
        for i in (range(length - 1, -1, -1) if reverse else range(length)):
            found += _expand(t.inner, jax.tree_util.tree_map(lambda a, i=i: a[i], stats), steps)
    return found


def _bytes(x: Any) -> int:
    return int(getattr(x, "nbytes", 0))


class _Segment(NamedTuple):
    compiled: Any
    templates: tuple
    stats: Any  # the structure of the statistics (shapes and dtypes), as traced
    temp_bytes: int


def _compile(part: Segment, values: list, flags: list, loss_scale: float, seconds: dict) -> _Segment:
    """The probed program of one segment, traced and compiled."""
    traced: list[_Collector] = []
    inputs, outputs = part.inputs, part.outputs

    def probed(values, flags):
        collector = _Collector(loss_scale, dict(zip(inputs, flags)))
        env = dict(zip(inputs, values))
        collector.execute(part.steps, env)
        collector.flush()
        traced.append(collector)
        return [env[o] for o in outputs], [collector.flag(o, env[o]) for o in outputs], pack(collector.arrays)

    start = time.perf_counter()
    lowered = jax.jit(probed).lower(values, flags)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    seconds["trace"] += lowered_at - start
    seconds["compile"] += time.perf_counter() - lowered_at
    analysis = compiled.memory_analysis()
    temp = int(getattr(analysis, "temp_size_in_bytes", 0)) if analysis is not None else 0
    stats = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), traced[-1].arrays)
    return _Segment(compiled, tuple(traced[-1].templates), stats, temp)


def run(fn: Any, args: Sequence[Any], loss_scale: float = 1.0, n_primal: int | None = None,
        compiled: dict | None = None) -> tuple[Any, list[Probe], dict[str, float]]:
    """Runs ``fn(*args)`` (any function of arrays, traced) with every op probed;
    returns its outputs, the probes in evaluation order, and the cost: the seconds
    spent tracing, compiling and running the probed program, how many segments it
    ran and compiled, and the peak bytes it held (live values plus a segment's
    temporaries). ``loss_scale``: the scale the program's loss was multiplied by
    (for the scale grid); ``n_primal``: for a differentiated ``fn``, how many of its
    leading outputs are primal (the ops only the others need count as backward);
    ``compiled``: the segments earlier runs compiled, keyed by structure, to reuse and
    add to (a diagnosis's verification runs change one module: the rest is compiled once)."""
    start = time.perf_counter()
    flat_args, in_tree = jax.tree_util.tree_flatten(args)
    closed, out_shape = jax.make_jaxpr(lambda *a: fn(*jax.tree_util.tree_unflatten(in_tree, a)),
                                       return_shape=True)(*flat_args)
    primal = None if n_primal is None else primal_eqns(closed.jaxpr, n_primal)
    program, constants = flatten(closed, primal)
    env = {k: jax.device_put(v) for k, v in constants.items()}
    env.update(zip(program.inputs, (jax.device_put(x) for x in flat_args)))
    flags = dict(zip(env, finite_flags(list(env.values()))))
    parts = plan(program, (loss_scale, host_platform()))
    seconds = {"trace": time.perf_counter() - start, "compile": 0.0}
    cache: dict[tuple, _Segment] = {} if compiled is None else compiled
    compiled_here = 0
    ran, live, peak = [], sum(_bytes(v) for v in env.values()), 0
    for part in parts:
        if part.key not in cache:
            compiled_here += 1
            cache[part.key] = _compile(part, [env[x] for x in part.inputs], [flags[x] for x in part.inputs],
                                       loss_scale, seconds)
        segment = cache[part.key]
        values, out_flags, arrays = segment.compiled([env[x] for x in part.inputs], [flags[x] for x in part.inputs])
        produced = sum(_bytes(v) for v in values)
        peak = max(peak, live + produced + segment.temp_bytes)
        env.update(zip(part.outputs, values))
        flags.update(zip(part.outputs, out_flags))
        live += produced
        for x in part.last_reads:
            live -= _bytes(env.pop(x))
        ran.append((part.steps, segment, arrays))
    outs = [x.val if isinstance(x, Literal) else env[x] for x in program.outputs]
    jax.block_until_ready(outs)
    found = []
    for part, segment, arrays in ran:
        found += _expand(segment.templates, unpack(jax.device_get(arrays), segment.stats), part)
    seconds["run"] = time.perf_counter() - start - seconds["trace"] - seconds["compile"]
    seconds.update(segments=len(parts), compiled=compiled_here, peak_bytes=peak)
    probes = [Probe(i, path, shown, backward, dtype, size, stats, narrowed)
              for i, (path, shown, backward, dtype, size, narrowed, stats) in enumerate(found)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs), probes, seconds
