"""Layer and RMS norms with their backward pass written in closed form.

JAX differentiates a norm written out (:mod:`.norm_pattern` finds them) op by op:
through the mean, the variance, ``rsqrt`` and the scale, which XLA compiles to two
row reductions in sequence, a small kernel between them, and the scale's and the
offset's gradients in reductions of their own: six kernels for each LayerNorm's
backward on a GPU. The closed form needs one row reduction for the input's gradient
(both its sums at once) and one column reduction for the scale's and the offset's
(stacked):

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

from precision.autocast.norm_pattern import Norm, find_norms
from precision.autocast.values import Val

__all__ = ["plan", "emit", "backward"]


def plan(jaxpr: Any, consts: dict, ctx: Any) -> dict[int, Norm]:
    """The norms of ``jaxpr`` to give a closed-form backward, by the index of their last equation."""
    if not ctx.ops.fuse_norms:
        return {}
    try:
        found = find_norms(jaxpr, consts)
    except Exception as e:  # noqa: BLE001 - an optimisation never fails a model: it runs as written
        warnings.warn(f"autocast: looking for layer norms failed ({type(e).__name__}: {e}); the model's norms "
                      f"are differentiated op by op. Please report this.", RuntimeWarning, stacklevel=2)
        return {}
    return {norm.last: norm for norm in found}


def _operands(norm: Norm) -> list[Any]:
    return [v for v in (norm.x, norm.scale, norm.offset) if v is not None]


def emit(norm: Norm, read: Callable[[Any], Val], op_by_op: Callable[[dict], dict]) -> Val:
    """The norm's result: ``op_by_op(given)`` (its equations rewritten with ``given`` Vals for
    its operands, giving their env) forward, :func:`backward` backward."""
    operands = _operands(norm)
    vals = [read(v) for v in operands]
    made: list[Val] = []

    def forward(*arrays):
        given = {var: Val(val.kind, a, val.path, None, val.leaf, val.const)
                 for var, val, a in zip(operands, vals, arrays)}
        env = op_by_op(given)
        made[:] = [env[norm.out]]
        mean = env[norm.mean].array if norm.mean is not None else None
        return env[norm.out].array, (mean, env[norm.rstd].array)

    @jax.custom_vjp
    def normalized(*arrays):
        return forward(*arrays)[0]

    def fwd(*arrays):
        out, stats = forward(*arrays)
        return out, (arrays, stats)

    def bwd(res, dy):
        arrays, (mean, rstd) = res
        return backward(norm, arrays, mean, rstd, dy)

    normalized.defvjp(fwd, bwd)
    array = normalized(*[v.array for v in vals])
    return Val(made[0].kind, array, made[0].path)


def backward(norm: Norm, arrays: tuple, mean: Any, rstd: Any, dy: Any) -> tuple:
    """The gradients of the norm's operands (x, then scale and offset where it has them)
    from its output's gradient ``dy``, in closed form, computed in float32."""
    x, rest = arrays[0], list(arrays[1:])
    scale = rest.pop(0) if norm.scale is not None else None
    offset = rest.pop(0) if norm.offset is not None else None
    keep = tuple(1 if a in norm.axes else d for a, d in enumerate(x.shape))
    f32 = lambda a: jnp.asarray(a).astype(jnp.float32)  # noqa: E731
    r = f32(rstd).reshape(keep)
    xhat = (f32(x) - f32(mean).reshape(keep) if mean is not None else f32(x)) * r
    g = f32(dy)
    dxhat = g * f32(scale) if scale is not None else g
    n = math.prod(x.shape[a] for a in norm.axes)
    inner = dxhat - xhat * (jnp.sum(dxhat * xhat, norm.axes, keepdims=True) / n)
    if mean is not None:
        inner = inner - jnp.sum(dxhat, norm.axes, keepdims=True) / n
    grads = [(r * inner).astype(x.dtype)]
    if scale is not None and offset is not None and jnp.shape(scale) == jnp.shape(offset):
        dims = _spread(jnp.shape(scale), x.shape)
        both = jnp.sum(jnp.stack([g * xhat, g]), tuple(d + 1 for d in dims))  # one reduction for both
        return (*grads, _as(both[0], scale), _as(both[1], offset))
    if scale is not None:
        grads.append(_as(jnp.sum(g * xhat, _spread(jnp.shape(scale), x.shape)), scale))
    if offset is not None:
        grads.append(_as(jnp.sum(g, _spread(jnp.shape(offset), x.shape)), offset))
    return tuple(grads)


def _spread(shape: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, ...]:
    """The dims of ``full`` an operand of ``shape`` is broadcast along (numpy's rule)."""
    aligned = (1,) * (len(full) - len(shape)) + tuple(shape)
    return tuple(d for d, (s, f) in enumerate(zip(aligned, full)) if s == 1 and f != 1)


def _as(total: Any, like: Any) -> Any:
    return total.reshape(jnp.shape(like)).astype(jnp.asarray(like).dtype)
