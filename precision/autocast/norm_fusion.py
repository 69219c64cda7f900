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

:func:`emit` makes a norm's result as a ``jax.custom_vjp``: its forward pass is the
norm's own equations rewritten op by op, exactly as without it (so the forward
values are the same bits); its backward is the closed form above, in float32,
each gradient given in its operand's dtype. It is the derivative the op-by-op
backward computes, up to rounding (and the ``max(0, .)`` a one-pass variance
clamps with, which only acts on constant rows, where ``xhat`` is 0).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from precision.autocast.norm_pattern import Norm, find_norms
from precision.autocast.values import Val

__all__ = ["plan", "schedule", "emit", "backward"]


def plan(jaxpr: Any, consts: dict, ctx: Any) -> dict[int, Norm]:
    """The norms of ``jaxpr`` to give a closed-form backward, by the index of their last equation.
    None under a half ``reduce_dtype``: a param's gradient is then summed over the batch in that
    dtype by the op that reads it (:mod:`.reductions`), which the closed form's float32 sums are not."""
    if not ctx.ops.fuse_norms or (ctx.reduce is not None and np.dtype(ctx.reduce).itemsize < 4):
        return {}
    try:
        found = find_norms(jaxpr, consts)
    except Exception as e:  # noqa: BLE001 - an optimisation never fails a model: it runs as written
        warnings.warn(f"autocast: looking for layer norms failed ({type(e).__name__}: {e}); the model's norms "
                      f"are differentiated op by op. Please report this.", RuntimeWarning, stacklevel=2)
        return {}
    return {norm.last: norm for norm in found}


def schedule(jaxpr: Any, found: dict, taken: set) -> tuple[dict, dict]:
    """The norms to make (by their last equation) that share no equation with an attention
    fused, and for each the equations before it reading the statistics it gives out (a
    BatchNorm's running averages), to run once it is made."""
    norms, later, claimed = {}, {}, set(taken)
    for last, norm in found.items():
        tainted, after = set(norm.stats_out), []
        for i in range(min(norm.eqns), last):
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

    @jax.custom_vjp
    def normalized(*arrays):
        return forward(*arrays)[0]

    def fwd(*arrays):
        outs, stats = forward(*arrays)
        return outs, (arrays, stats)

    def bwd(res, cotangents):
        arrays, (mean, rstd) = res
        dy, *dstats = cotangents
        return backward(norm, arrays, mean, rstd, dy, dict(zip(norm.stats_out, dstats)))

    normalized.defvjp(fwd, bwd)
    arrays = normalized(*[v.array for v in vals])
    return {var: Val(val.kind, a, val.path) for var, val, a in zip(results, made, arrays)}


def backward(norm: Norm, arrays: tuple, mean: Any, rstd: Any, dy: Any, dstats: dict | None = None) -> tuple:
    """The gradients of the norm's operands (x, then scale and offset where it has them)
    from its output's gradient ``dy`` (and its statistics' given out, ``dstats`` by var), in
    closed form, computed in float32."""
    x, rest = arrays[0], list(arrays[1:])
    scale = rest.pop(0) if norm.scale is not None else None
    offset = rest.pop(0) if norm.offset is not None else None
    keep = _keep(norm, x.shape)
    f32 = lambda a: jnp.asarray(a).astype(jnp.float32)  # noqa: E731
    r = f32(rstd).reshape(keep)
    centred = f32(x) - f32(mean).reshape(keep) if mean is not None else f32(x)
    xhat = centred * r
    g = f32(dy)
    n = math.prod(x.shape[a] for a in norm.axes)
    sc = f32(scale) if scale is not None else None
    if all(p is None or _spread(jnp.shape(p), x.shape) == norm.axes for p in (scale, offset)):
        return _per_channel(norm, x, g, xhat, centred, r, n, sc, scale, offset, mean is not None, dstats)
    dxhat = g * sc if sc is not None else g
    inner = dxhat - xhat * (jnp.sum(dxhat * xhat, norm.axes, keepdims=True) / n)
    if mean is not None:
        inner = inner - jnp.sum(dxhat, norm.axes, keepdims=True) / n
    grads = [_with_stats(norm, r * inner, centred, n, dstats).astype(x.dtype)]
    if scale is not None and offset is not None and jnp.shape(scale) == jnp.shape(offset):
        dims = _spread(jnp.shape(scale), x.shape)
        both = jnp.sum(jnp.stack([g * xhat, g]), tuple(d + 1 for d in dims))  # one reduction for both
        return (*grads, _as(both[0], scale), _as(both[1], offset))
    if scale is not None:
        grads.append(_as(jnp.sum(g * xhat, _spread(jnp.shape(scale), x.shape)), scale))
    if offset is not None:
        grads.append(_as(jnp.sum(g, _spread(jnp.shape(offset), x.shape)), offset))
    return tuple(grads)


def _with_stats(norm: Norm, dx: Any, centred: Any, n: int, dstats: dict | None) -> Any:
    """``dx`` plus what the statistics given out add: d mean / dx = 1/n, d variance / dx = 2 (x - mean) / n."""
    for var, d in (dstats or {}).items():
        d = jnp.asarray(d).astype(jnp.float32).reshape(_keep(norm, centred.shape))
        dx = dx + (d / n if var is norm.mean else d * (2.0 / n) * centred)
    return dx


def _keep(norm: Norm, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if a in norm.axes else d for a, d in enumerate(shape))


def _per_channel(norm: Norm, x: Any, g: Any, xhat: Any, centred: Any, r: Any, n: int, sc: Any, scale: Any,
                 offset: Any, has_mean: bool, dstats: dict | None) -> tuple:
    """The backward of a norm whose scale and offset vary only along the dims it does not
    normalise (a BatchNorm's, per channel): their gradients are the very sums the input's
    needs, so one reduction gives all of them."""
    terms = [g * xhat] + ([g] if has_mean or offset is not None else [])
    sums = jnp.sum(jnp.stack(terms), tuple(a + 1 for a in norm.axes), keepdims=True)
    s1 = sums[0]
    s0 = sums[1] if len(terms) > 1 else None
    gain = sc if sc is not None else 1.0
    inner = g * gain - xhat * (gain * s1 / n)
    if has_mean:
        inner = inner - gain * s0 / n
    grads = [_with_stats(norm, r * inner, centred, n, dstats).astype(x.dtype)]
    if scale is not None:
        grads.append(_as(s1, scale))
    if offset is not None:
        grads.append(_as(s0, offset))
    return tuple(grads)


def _spread(shape: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, ...]:
    """The dims of ``full`` an operand of ``shape`` is broadcast along (numpy's rule)."""
    aligned = (1,) * (len(full) - len(shape)) + tuple(shape)
    return tuple(d for d, (s, f) in enumerate(zip(aligned, full)) if s == 1 and f != 1)


def _as(total: Any, like: Any) -> Any:
    return total.reshape(jnp.shape(like)).astype(jnp.asarray(like).dtype)
