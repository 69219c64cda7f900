"""Evaluating a traced program with a probe on every op: what each op computed,
read in float32 from the dtype it computed in.

The program is the one the policy runs (a model under :func:`precision.with_policy`
or :func:`precision.autocast`, differentiated by ``jax.value_and_grad``: forward
and backward in one jaxpr). :func:`run` evaluates it again, equation by equation,
inside one ``jax.jit``, and after each equation measures its floating outputs:

- the largest finite magnitude (``amax``), and how many values are inf or NaN,
  with whether the equation's inputs were all finite (an op that *makes* a
  non-finite value from finite inputs is where numerics failed);
- for outputs in float16 / bfloat16, the op computed again from the same inputs
  in float32 (the *shadow*): how many values are non-zero there but zero in the
  half result (flushed), and how many are subnormal; for float16 in the backward
  pass, how many would flush at each loss scale ``2**0 .. 2**24`` (the cotangents
  scale with the loss scale), so the scales that keep gradients can be read off.

jit, pjit, remat, custom_jvp/vjp calls are evaluated inline and scans unrolled,
so every op of every layer is probed; of a ``jax.lax.platform_dependent`` choice,
the branch for this machine is evaluated inline too; ``while``, other ``cond``s and
``shard_map`` run as they are, probed as one op. The training step itself is never touched: this
is a separate program, run for a diagnosis.
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
from jax.extend.core import DropVar, Literal

from precision.autocast.program import MOVES, binders, host_platform, platform_branch
from precision.autocast.regions import module_path, scope_names

__all__ = ["SCALES", "Probe", "run"]

F32 = np.dtype(np.float32)
HALF = (np.dtype(np.float16), np.dtype(jnp.bfloat16))
#: The loss scales at which float16 backward flushes are counted: 2**0 .. 2**24.
SCALES = tuple(2.0 ** k for k in range(25))
_F16_ZERO_EXPONENT = -25  # below 2**-25, half float16's smallest subnormal (2**-24), a value rounds to zero
_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
           "custom_vjp_call": "call_jaxpr", "custom_lin": None}


#: Ops that only move, pick or copy values (no rounding, no new magnitude): not probed (their
#: inputs and consumers are), which keeps the probed program small.
_MOVES_VALUES = MOVES | {"dynamic_update_slice", "concatenate", "select_n", "neg", "abs", "max", "min", "reduce_max",
                         "reduce_min", "stop_gradient", "pad", "gather", "optimization_barrier"}


_MATMULS = ("dot_general", "conv_general_dilated")


class Probe(NamedTuple):
    """What was measured at one output of one op (the arrays come back from the device)."""

    index: int  # evaluation order: forward ops come before the backward ones
    path: tuple[str, ...]  # module path
    primitive: str
    backward: bool
    dtype: np.dtype
    size: int
    stats: dict  # name -> scalar (host values after the run)
    narrowed: bool = False  # the op's float32 result as cast to half (the cast is what was measured)


def _is_float(aval: Any) -> bool:
    return hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating)


def _measure(out: jax.Array, shadow: jax.Array | None, inputs_finite: jax.Array, backward: bool,
             loss_scale: float) -> dict:
    """The scalar statistics of one output (traced). The counts are one reduction over
    stacked masks, the maxima another: a few reductions per op keep the probed
    program quick to compile."""
    out = jax.lax.optimization_barrier(out)  # a value XLA could fold (from constants) is measured at run time
    shadow = None if shadow is None else jax.lax.optimization_barrier(shadow)
    x = out.astype(jnp.float32).reshape(-1)
    magnitude = jnp.abs(x)
    counts = {"inf": jnp.isinf(x), "nan": jnp.isnan(x)}
    maxima = {"amax": jnp.where(jnp.isfinite(x), magnitude, 0.0)}
    flushed_at = None
    if np.dtype(out.dtype) in HALF:
        tiny = float(jnp.finfo(out.dtype).tiny)
        counts["subnormal"] = (x != 0) & (magnitude < tiny)
        if shadow is not None:
            ref = shadow.astype(jnp.float32).reshape(-1)
            ref_magnitude = jnp.abs(ref)
            ref_finite = jnp.isfinite(ref)
            nonzero = (ref != 0) & ref_finite
            counts["nonzero_ref"] = nonzero
            counts["flushed"] = nonzero & (x == 0)
            counts["overflow"] = jnp.isinf(x) & ref_finite  # past the half range, finite in float32
            maxima["ref_amax"] = jnp.where(ref_finite, ref_magnitude, 0.0)
            if backward and np.dtype(out.dtype) == np.float16:
                # At loss scale 2**k a value t (at scale 1) flushes when t * 2**k < 2**-25, that is when
                # k < -25 - floor(log2 t): a histogram of that bound (one scatter-add) counts every scale.
                exponent = jnp.floor(jnp.log2(jnp.maximum(ref_magnitude / loss_scale, 1e-45)))
                bound = jnp.clip(_F16_ZERO_EXPONENT - exponent, 0, len(SCALES)).astype(jnp.int32)
                histogram = jnp.zeros(len(SCALES) + 1, jnp.int32).at[bound].add(nonzero.astype(jnp.int32))
                flushed_at = jnp.cumsum(histogram[::-1])[::-1][1:]  # flushed at 2**k: bound > k
    names = list(counts)
    summed = jnp.sum(jnp.stack([counts[k] for k in names]).astype(jnp.int32), axis=1)
    stats = {k: summed[i] for i, k in enumerate(names)}
    peaks = jnp.max(jnp.stack(list(maxima.values())), axis=1, initial=0.0)
    stats.update({k: peaks[i] for i, k in enumerate(maxima)})
    stats["inputs_finite"] = inputs_finite
    if flushed_at is not None:
        stats["flushed_at"] = flushed_at
    return stats


def _shadow(eqn: Any, ins: Sequence[Any], index: int) -> Any:
    """Output ``index`` of ``eqn`` computed from the same inputs in float32, or None."""
    name = eqn.primitive.name
    if name in ("convert_element_type", "reduce_precision"):
        return ins[0] if _is_float(eqn.invars[0].aval) else None  # the value before it was narrowed
    if name.startswith("scatter") or any(hasattr(v, "eqns") or hasattr(v, "jaxpr") for v in eqn.params.values()):
        return None  # a program typed in its dtypes (a scatter's update, a reduction's body): no float32 twin
    wide = [x.astype(jnp.float32) if hasattr(x, "dtype") and np.dtype(x.dtype) in HALF else x for x in ins]
    params = dict(eqn.params)
    if params.get("preferred_element_type") is not None:
        params["preferred_element_type"] = F32
    try:
        out = eqn.primitive.bind(*wide, **params)
    except Exception:  # noqa: BLE001 - an op that only exists in its dtypes: no shadow
        return None
    out = out if eqn.primitive.multiple_results else [out]
    if index >= len(out) or np.dtype(out[index].dtype) != F32:
        return None
    return out[index]


def _primal_eqns(jaxpr: Any, n_primal: int) -> set[int]:
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


class _Run:
    """One probing evaluation: the probes found, in order."""

    def __init__(self, loss_scale: float):
        self.loss_scale = loss_scale
        self.probes: list[tuple[int, tuple, str, bool, np.dtype, int, bool]] = []
        self.arrays: list[dict] = []
        self.finite: dict[int, tuple[Any, jax.Array]] = {}  # id(value) -> (value, all finite): counted once
        self.made_by: dict[int, tuple[str, Any]] = {}  # id(value) -> (the matmul that made it, the value)

    def _finite(self, x: Any) -> jax.Array:
        """Whether every value of ``x`` is finite: from its probe when an op made it, else reduced once."""
        if id(x) not in self.finite:
            self.finite[id(x)] = (x, jnp.all(jnp.isfinite(x)))  # the value is kept: its id stays its own
        return self.finite[id(x)][1]

    def evaluate(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], prefix: tuple = (),
                 backward: bool = False, primal: set[int] | None = None) -> list:
        """Evaluates ``jaxpr``, probing its ops; ``primal``: the indices of the equations
        the primal outputs need (the others are derivative work), None: all."""
        env = dict(zip(binders(jaxpr), [*consts, *args], strict=True))

        def read(v):
            return v.val if isinstance(v, Literal) else env[v]

        for index, eqn in enumerate(jaxpr.eqns):
            stack = getattr(eqn.source_info.name_stack, "stack", ())
            scope = prefix + scope_names(eqn.source_info.name_stack)
            is_backward = (backward or (primal is not None and index not in primal)
                           or any(type(e).__name__ == "Transform" and e.name == "transpose" for e in stack))
            ins = [read(v) for v in eqn.invars]
            outs = self._eqn(eqn, ins, scope, is_backward)
            for var, out in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, DropVar):
                    env[var] = out
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, ins: list, scope: tuple, backward: bool) -> list:
        name = eqn.primitive.name
        if name in _INLINE and _INLINE[name] and _INLINE[name] in eqn.params:
            sub = eqn.params[_INLINE[name]]
            jaxpr, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
            return self.evaluate(jaxpr, consts, ins, scope, backward)
        if name == "scan" and int(eqn.params["length"]) > 0:
            return self._scan(eqn, ins, scope, backward)
        branch = platform_branch(eqn, host_platform())
        if branch is not None:  # jax.lax.platform_dependent: the branch this machine runs, probed op by op
            sub = eqn.params["branches"][branch]
            return self.evaluate(sub.jaxpr, sub.consts, ins[1:], scope, backward)
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        if name in _MATMULS:
            self.made_by.update((id(out), (name, out)) for out in outs)
        if name in _MOVES_VALUES:
            return outs
        # A matmul's float32 result cast to half: the cast overflows, the matmul is what the user wrote.
        made_by = self.made_by.get(id(ins[0]), ("",))[0] if name == "convert_element_type" else ""
        shown = made_by or name
        floats_in = [x for x, v in zip(ins, eqn.invars) if _is_float(v.aval)]
        inputs_finite = jnp.all(jnp.stack([self._finite(x) for x in floats_in])) if floats_in else jnp.array(True)
        for i, (out, var) in enumerate(zip(outs, eqn.outvars)):
            if _is_float(var.aval) and np.dtype(var.aval.dtype) in (*HALF, F32) and math.prod(var.aval.shape):
                shadow = _shadow(eqn, ins, i) if np.dtype(var.aval.dtype) in HALF else None
                self.probes.append((len(self.probes), module_path(scope), shown, backward, np.dtype(var.aval.dtype),
                                    int(math.prod(var.aval.shape)), bool(made_by)))
                stats = _measure(out, shadow, inputs_finite, backward, self.loss_scale)
                self.arrays.append(stats)
                self.finite[id(out)] = (out, stats["inf"] + stats["nan"] == 0)
        return outs

    def _scan(self, eqn: Any, ins: list, scope: tuple, backward: bool) -> list:
        """A scan unrolled: its body evaluated (and probed) once per iteration."""
        from precision.autocast.higher_order import _scan_counts

        params = eqn.params
        n_consts, n_carry = _scan_counts(params)
        body = params["jaxpr"]
        consts, carry, xs = ins[:n_consts], list(ins[n_consts:n_consts + n_carry]), ins[n_consts + n_carry:]
        length, ys = int(params["length"]), []
        order = range(length - 1, -1, -1) if params.get("reverse") else range(length)
        for i in order:
            outs = self.evaluate(body.jaxpr, body.consts, [*consts, *carry, *(x[i] for x in xs)], scope, backward)
            carry, y = outs[:n_carry], outs[n_carry:]
            ys.append(y)
        if params.get("reverse"):
            ys.reverse()
        stacked = [jnp.stack([y[j] for y in ys]) for j in range(len(ys[0]))] if ys else []
        return [*carry, *stacked]


def run(fn: Any, args: Sequence[Any], loss_scale: float = 1.0, n_primal: int | None = None
        ) -> tuple[Any, list[Probe], dict[str, float]]:
    """Runs ``fn(*args)`` (any function of arrays, traced) with every op probed;
    returns its outputs, the probes in evaluation order, and the seconds spent
    tracing, compiling and running the probed program. ``loss_scale``: the scale
    the program's loss was multiplied by (for the scale grid); ``n_primal``: for a
    differentiated ``fn``, how many of its leading outputs are primal (the ops only
    the others need count as backward)."""
    start = time.perf_counter()
    flat_args, in_tree = jax.tree_util.tree_flatten(args)
    closed, out_shape = jax.make_jaxpr(lambda *a: fn(*jax.tree_util.tree_unflatten(in_tree, a)),
                                       return_shape=True)(*flat_args)
    probing = _Run(loss_scale)
    primal = None if n_primal is None else _primal_eqns(closed.jaxpr, n_primal)

    def instrumented(consts, flat):  # constants as arguments: XLA would otherwise fold reductions over them
        outs = probing.evaluate(closed.jaxpr, consts, flat, primal=primal)
        return outs, probing.arrays

    consts = list(closed.consts)
    lowered = jax.jit(instrumented).lower(consts, flat_args)
    traced = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    outs, arrays = jax.block_until_ready(compiled(consts, flat_args))
    arrays = jax.device_get(arrays)
    seconds = {"trace": traced - start, "compile": compiled_at - traced, "run": time.perf_counter() - compiled_at}
    probes = [Probe(i, path, prim, backward, dtype, size, {k: np.asarray(v) for k, v in stats.items()}, narrowed)
              for (i, path, prim, backward, dtype, size, narrowed), stats in zip(probing.probes, arrays)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs), probes, seconds
