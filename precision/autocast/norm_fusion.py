"""Layer, RMS and batch norms with their backward pass written in closed form.

JAX differentiates a norm written out (:mod:`.norm_pattern` finds them) op by op:
through the mean, the variance, ``rsqrt`` and the scale, which XLA compiles to two
row reductions in sequence, a small kernel between them, and the scale's and the
offset's gradients in reductions of their own: six kernels for each LayerNorm's
backward on a GPU. The closed form needs one row reduction for the input's gradient
(both its sums at once) and one column reduction for the scale's and the offset's
(stacked; a BatchNorm's, per channel, are the very sums the input's needs):

    xhat   = (x - mean) * rstd                  (x * rstd for an RMS norm)
    dxhat  = dy * scale
    dx     = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    dscale = sum(dy * xhat),  doffset = sum(dy)  (over the dims they broadcast along)

:func:`emit` makes a norm's result with its own derivative rule: its forward pass is
the norm's own equations rewritten op by op, exactly as without it (so the forward
values are the same bits). A layer or RMS norm gets a ``jax.custom_jvp`` whose tangent
is the linear map above written so that JAX's transpose of it is that backward (forward
mode, ``jax.jvp`` and Hessian-vector products, work as before). A norm with a per-channel
scale or offset (a BatchNorm) gets a ``jax.custom_vjp`` with the backward written out,
where the scale's and offset's sums are the input gradient's own: XLA compiles JAX's
transpose of the same tangent to 45 more kernels on the ResNet, so forward-mode
differentiation through a BatchNorm in training needs ``fuse_norms=False``. All in
float32, each derivative in its operand's dtype: the op-by-op derivative up to rounding
(and the ``max(0, .)`` a one-pass variance clamps with, which only acts on constant rows,
where ``xhat`` is 0).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from precision.autocast.norm_pattern import Norm, describe, survey
from precision.autocast.regions import module_path, scope_names
from precision.autocast.values import Record, Val

__all__ = ["plan", "schedule", "emit", "backward", "NORM", "CLOSED_FORM", "AS_WRITTEN"]


#: The name explain's log gives a norm's report (:func:`plan`), as ``"attention"`` an attention's.
NORM = "norm"
#: What the norms given their closed-form backward are (explain's count), and how one left so is reported.
CLOSED_FORM = "differentiated in closed form"
AS_WRITTEN = "left as written"


def plan(jaxpr: Any, consts: dict, ctx: Any, taken: set) -> tuple[dict[int, Norm], dict[int, list[int]]]:
    """The norms of ``jaxpr`` to give a closed-form backward, by the index of their last
    equation, and the equations each must run after it (:func:`schedule`; ``taken``: those
    of attentions fused). Logs, per module, each norm differentiated in closed form and each
    left as written, with why (closed-form norms turned off; under a half ``reduce_dtype`` a
    param's gradient is summed in that dtype by the op that reads it, which the closed form's
    float32 sums are not; its centred values read elsewhere...)."""
    off = _why_off(ctx)
    if off and ctx.log is None:
        return {}, {}
    try:
        found, missed = survey(jaxpr, consts)
    except Exception as e:  # noqa: BLE001 - an optimisation never fails a model: it runs as written
        warnings.warn(f"autocast: looking for norms failed ({type(e).__name__}: {e}); the model's norms "
                      f"are differentiated op by op. Please report this.", RuntimeWarning, stacklevel=2)
        return {}, {}
    norms, later = schedule(jaxpr, {} if off else {norm.last: norm for norm in found}, taken)
    if ctx.log is not None:
        for norm in found:
            why = off or "it shares operations with an attention fused"
            _log(ctx, jaxpr, norm.eqns, describe(norm) + ("" if norm.last in norms else f", {AS_WRITTEN}: {why}"))
        for index, why in missed:
            _log(ctx, jaxpr, {index}, f"{AS_WRITTEN}: {why}")
    return norms, later


def _why_off(ctx: Any) -> str:
    """Why no norm of this program gets the closed form ("" where they may)."""
    if not ctx.ops.fuse_norms:
        return "closed-form norms are off (fuse_norms=False)"
    if ctx.reduce is not None and np.dtype(ctx.reduce).itemsize < 4:
        return (f"gradients are reduced in {np.dtype(ctx.reduce).name} (reduce_dtype): a param's is summed in it "
                f"by the op that reads it")
    return ""


def _log(ctx: Any, jaxpr: Any, eqns: Any, how: str) -> None:
    """A norm's report, under the module of its outermost equation."""
    first = min((jaxpr.eqns[i] for i in sorted(eqns)), key=lambda e: len(scope_names(e.source_info.name_stack)))
    ctx.log.append(Record(module_path(ctx.prefix + scope_names(first.source_info.name_stack)), NORM,
                          np.dtype(np.float32), how))


def schedule(jaxpr: Any, found: dict, taken: set) -> tuple[dict, dict]:
    """The norms to make (by their last equation) that share no equation with an attention
    fused, and for each the equations before it reading the statistics it gives out (a
    BatchNorm's running averages), to run once it is made."""
    norms, later, claimed = {}, {}, set(taken)
    for last, norm in found.items():
        tainted, after = set(norm.stats_out), []
        for i in range(min(norm.eqns), last) if tainted else ():
            eqn = jaxpr.eqns[i]
            if i not in norm.eqns and any(v in tainted for v in eqn.invars if not isinstance(v, Literal)):
                tainted.update(eqn.outvars)
                after.append(i)
        if not (norm.eqns | set(after)) & claimed:
            norms[last], later[last] = norm, after
            claimed |= norm.eqns | set(after)
    return norms, later


def _operands(norm: Norm) -> list[Any]:
    return [v for v in (norm.x, norm.scale, norm.offset) if v is not None]


def emit(norm: Norm, read: Callable[[Any], Val], op_by_op: Callable[[dict], dict]) -> dict[Any, Val]:
    """The norm's result (and the statistics it gives out), by var: ``op_by_op(given)`` (its
    equations rewritten with ``given`` Vals for its operands, giving their env) forward,
    :func:`backward` backward."""
    operands = _operands(norm)
    vals = [read(v) for v in operands]
    made: list[Val] = []

    results = (norm.out, *norm.stats_out)

    def forward(*arrays):
        given = {var: Val(val.kind, a, val.path, None, val.leaf, val.const)
                 for var, val, a in zip(operands, vals, arrays)}
        env = op_by_op(given)
        made[:] = [env[v] for v in results]
        mean = env[norm.mean].array if norm.mean is not None else None
        return tuple(v.array for v in made), (mean, env[norm.rstd].array)

    if per_channel(norm):  # a custom VJP: XLA then shares the sums (see backward)
        normalized = jax.custom_vjp(lambda *arrays: forward(*arrays)[0])

        def fwd(*arrays):
            outs, stats = forward(*arrays)
            return outs, (arrays, stats)

        def bwd(res, cotangents):
            arrays, (mean, rstd) = res
            return backward(norm, arrays, mean, rstd, cotangents[0], dict(zip(norm.stats_out, cotangents[1:])))

        normalized.defvjp(fwd, bwd)
    else:  # a custom JVP, transposed by JAX: forward mode works too
        normalized = jax.custom_jvp(lambda *arrays: forward(*arrays)[0])

        def jvp(primals, tangents):
            outs, (mean, rstd) = forward(*primals)
            return outs, tangent(norm, primals, mean, rstd, tangents, outs)

        normalized.defjvp(jvp)
    arrays = normalized(*[v.array for v in vals])
    return {var: Val(val.kind, a, val.path) for var, val, a in zip(results, made, arrays)}


def _f32(a: Any) -> Any:
    return jnp.asarray(a).astype(jnp.float32)


def _unpacked(norm: Norm, arrays: tuple) -> tuple[Any, Any, Any]:
    """(x, scale, offset) from the norm's operands (or their tangents), None where it has none."""
    rest = list(arrays[1:])
    return (arrays[0], rest.pop(0) if norm.scale is not None else None,
            rest.pop(0) if norm.offset is not None else None)


def _standardized(norm: Norm, x: Any, mean: Any, rstd: Any) -> tuple:
    """(keepdims shape, n, rstd, x - mean, xhat), in float32, shaped to broadcast against x."""
    keep = _keep(norm, x.shape)
    r = _f32(rstd).reshape(keep)
    centred = _f32(x) - _f32(mean).reshape(keep) if mean is not None else _f32(x)
    return keep, math.prod(x.shape[a] for a in norm.axes), r, centred, centred * r


def tangent(norm: Norm, arrays: tuple, mean: Any, rstd: Any, tangents: tuple, outs: tuple) -> tuple:
    """The tangents of the norm's result and statistics from its operands' (linear in them;
    their transpose is the closed-form backward), computed in float32."""
    x, scale, offset = _unpacked(norm, arrays)
    tx, tscale, toffset = _unpacked(norm, tangents)
    keep, n, r, centred, xhat = _standardized(norm, x, mean, rstd)
    t = _f32(tx)
    mean_of = lambda a: jnp.sum(a, norm.axes, keepdims=True) / n  # noqa: E731
    inner = t - xhat * mean_of(t * xhat)
    if mean is not None:
        inner = inner - mean_of(t)
    tout = r * inner * (_f32(scale) if scale is not None else 1.0)
    if scale is not None and offset is not None and jnp.shape(scale) == jnp.shape(offset):
        rank = (1,) * (x.ndim - jnp.ndim(scale)) + jnp.shape(scale)
        both = jnp.stack([_f32(tscale).reshape(rank), _f32(toffset).reshape(rank)])  # transposed: one reduction
        tout = tout + jnp.sum(both * jnp.stack([xhat, jnp.ones_like(xhat)]), 0)
    else:
        if scale is not None:
            tout = tout + xhat * _f32(tscale)
        if offset is not None:
            tout = tout + _f32(toffset)
    results = [tout.astype(outs[0].dtype)]
    for var, out in zip(norm.stats_out, outs[1:]):
        moment = t if var is norm.mean else 2.0 * centred * t
        results.append((jnp.sum(moment, norm.axes) / n).reshape(out.shape).astype(out.dtype))
    return tuple(results)


def backward(norm: Norm, arrays: tuple, mean: Any, rstd: Any, dy: Any, dstats: dict) -> tuple:
    """The gradients of a per-channel norm's operands (x, then scale and offset where it has
    them) from its output's gradient ``dy`` and its statistics' (``dstats`` by var), in closed
    form, in float32: the scale's and the offset's gradients are the very sums the input's
    needs, so one reduction gives all of them."""
    x, scale, offset = _unpacked(norm, arrays)
    keep, n, r, centred, xhat = _standardized(norm, x, mean, rstd)
    g = _f32(dy)
    terms = [g * xhat] + ([g] if mean is not None or offset is not None else [])
    sums = jnp.sum(jnp.stack(terms), tuple(a + 1 for a in norm.axes), keepdims=True)
    gain = _f32(scale).reshape(keep) if scale is not None else 1.0
    inner = g * gain - xhat * (gain * sums[0] / n)
    if mean is not None:
        inner = inner - gain * sums[1] / n
    dx = r * inner
    for var, d in dstats.items():  # d mean / dx = 1/n; d variance / dx = 2 (x - mean) / n
        d = _f32(d).reshape(keep)
        dx = dx + (d / n if var is norm.mean else d * (2.0 / n) * centred)
    grads = [dx.astype(x.dtype)]
    if scale is not None:
        grads.append(_as(sums[0], scale))
    if offset is not None:
        grads.append(_as(sums[1], offset))
    return tuple(grads)


def per_channel(norm: Norm) -> bool:
    """Whether the norm's scale and offset (one at least) vary only along the dims it does
    not normalise (a BatchNorm's: per channel)."""
    shape = norm.x.aval.shape
    params = [v for v in (norm.scale, norm.offset) if v is not None]
    return bool(params) and all(_spread(v.aval.shape, shape) == norm.axes for v in params)


def _keep(norm: Norm, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if a in norm.axes else d for a, d in enumerate(shape))


def _spread(shape: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, ...]:
    """The dims of ``full`` an operand of ``shape`` is broadcast along (numpy's rule)."""
    aligned = (1,) * (len(full) - len(shape)) + tuple(shape)
    return tuple(d for d, (s, f) in enumerate(zip(aligned, full)) if s == 1 and f != 1)


def _as(total: Any, like: Any) -> Any:
    return total.reshape(jnp.shape(like)).astype(jnp.asarray(like).dtype)
