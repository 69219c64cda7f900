"""Masks and constants of a softmax attention found in a traced program.

:mod:`.attention_pattern` finds the attention; this module reads what it needs
from the values around it: constants folded (a scale ``1/sqrt(d)``, a mask fill
of ``finfo.min``), a mask computed from constants alone (``nn.make_causal_mask``,
``jnp.tril``) recognised as causal, and masks and biases taken *before* the
broadcast that spread them over the logits, so a fused call reads a
``(batch, 1, 1, keys)`` padding mask, not a ``(batch, heads, queries, keys)`` copy.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

__all__ = ["Graph", "MASK_FILL", "constant", "is_where", "where_parts", "causal", "causal_bias", "keep_mask", "narrowed"]

#: Masked logits get at most this (a large negative fill): exp underflows to 0 exactly.
MASK_FILL = -1e4
#: Largest constant array folded to find a causal mask or a scale.
_FOLD_LIMIT = 1 << 24


class Graph:
    """Producers and uses of a program's vars, and the values of its constants."""

    def __init__(self, jaxpr: Any, consts: dict | None = None):
        self.jaxpr = jaxpr
        self.consts = consts or {}
        self.producer: dict[Any, int] = {}
        self.uses: dict[Any, list[int]] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                self.producer[v] = i
            for v in eqn.invars:
                if not isinstance(v, Literal):
                    self.uses.setdefault(v, []).append(i)
        self.outputs = {v for v in jaxpr.outvars if not isinstance(v, Literal)}

    def eqn(self, var: Any) -> Any:
        if isinstance(var, Literal):
            return None
        i = self.producer.get(var)
        return None if i is None else self.jaxpr.eqns[i]

    def only_used_by(self, var: Any, eqns: set[int]) -> bool:
        if isinstance(var, Literal):
            return True
        return var not in self.outputs and set(self.uses.get(var, [])) <= eqns


def prim(eqn: Any) -> str:
    return "" if eqn is None else eqn.primitive.name


def constant(graph: Graph, var: Any, depth: int = 0) -> Any:
    """The value of ``var`` when it is computed from literals and concrete constants alone
    (None otherwise)."""
    if isinstance(var, Literal):
        return np.asarray(var.val)
    if var in graph.consts:
        value = graph.consts[var]
        return None if isinstance(value, jax.core.Tracer) else np.asarray(value)
    eqn = graph.eqn(var)
    call = prim(eqn) in ("jit", "pjit")  # jnp.tril, jnp.where...: a program of its own
    if eqn is None or depth > 24 or eqn.effects or (
            not call and any(hasattr(p, "jaxpr") for p in eqn.params.values())):
        return None
    if math.prod(getattr(var.aval, "shape", ())) > _FOLD_LIMIT:
        return None
    ins = [constant(graph, v, depth + 1) for v in eqn.invars]
    if any(x is None for x in ins):
        return None
    with jax.ensure_compile_time_eval():
        if call:
            inner = eqn.params["jaxpr"]
            out = jax.core.eval_jaxpr(inner.jaxpr, inner.consts, *ins)
        else:
            out = eqn.primitive.bind(*ins, **eqn.params)
    out = out[eqn.outvars.index(var)] if call or eqn.primitive.multiple_results else out
    return np.asarray(out)


def is_where(eqn: Any) -> bool:
    """A ``jnp.where`` traced as its own jit: (mask..., x, fill) -> select_n(pred, fill, x)."""
    inner = eqn.params["jaxpr"].jaxpr
    return bool(inner.eqns) and prim(inner.eqns[-1]) == "select_n" and len(inner.outvars) == 1


def where_parts(graph: Graph, eqn: Any) -> tuple[Any, Any]:
    """(mask, logits) of a ``jnp.where(mask, logits, fill)`` jit: the mask as (the eqn, the
    operand index of the mask); (None, None) when it is not a large-negative fill of logits."""
    jaxpr = eqn.params["jaxpr"].jaxpr
    pred, on_false, on_true = jaxpr.eqns[-1].invars
    outer = dict(zip(jaxpr.invars, eqn.invars))
    if on_true not in outer:
        return None, None
    fill_var = on_false
    fill_eqn = next((e for e in jaxpr.eqns if fill_var in e.outvars), None)
    if fill_eqn is not None and prim(fill_eqn) == "broadcast_in_dim":
        fill_var = fill_eqn.invars[0]
    fill = np.asarray(fill_var.val) if isinstance(fill_var, Literal) else (
        constant(graph, outer[fill_var]) if fill_var in outer else None)
    if fill is None or float(np.max(fill)) > MASK_FILL:
        return None, None
    masks = [i for i, v in enumerate(jaxpr.invars) if v is not on_true and v is not fill_var]
    if len(masks) != 1 or not _reads_only(jaxpr, jaxpr.invars[masks[0]], pred):
        return None, None
    return (eqn, masks[0]), outer[on_true]


def _reads_only(jaxpr: Any, source: Any, target: Any) -> bool:
    """Whether ``target`` is computed from ``source`` and literals alone inside ``jaxpr``."""
    known = {source}
    for eqn in jaxpr.eqns[:-1]:
        if all(isinstance(v, Literal) or v in known for v in eqn.invars):
            known.update(eqn.outvars)
    return target in known


def keep_mask(mask: Any, value: Any, narrow: bool = False) -> Any:
    """The boolean keep-mask of the attention's ``mask`` (a var, or a ``jnp.where`` jit and
    the index of its mask operand) from ``value``, the mask operand's value; ``narrow``:
    before the broadcast that spreads it over the logits (same rank, 1 where spread)."""
    if not isinstance(mask, tuple):
        return value.astype(bool)
    eqn, index = mask
    jaxpr = eqn.params["jaxpr"].jaxpr
    pred = jaxpr.eqns[-1].invars[0]
    spread = next((e for e in jaxpr.eqns if pred in e.outvars and prim(e) == "broadcast_in_dim"), None)
    if narrow and spread is not None:
        pred = spread.invars[0]
    env = {jaxpr.invars[index]: value}
    for inner in jaxpr.eqns[:-1]:
        if inner is spread and narrow:
            break
        if all(isinstance(v, Literal) or v in env for v in inner.invars):
            vals = [v.val if isinstance(v, Literal) else env[v] for v in inner.invars]
            out = inner.primitive.bind(*vals, **inner.params)
            for v, o in zip(inner.outvars, out if inner.primitive.multiple_results else [out]):
                env[v] = o
    out = env[pred]
    if narrow and spread is not None:
        out = _unspread(out, spread.params["shape"], spread.params["broadcast_dimensions"])
    return out.astype(bool)


def _unspread(operand: Any, shape: tuple[int, ...], dims: tuple[int, ...]) -> Any:
    """``operand`` of a ``broadcast_in_dim`` to ``shape`` reshaped to that rank, 1 where spread."""
    narrow = [1] * len(shape)
    for i, d in enumerate(dims):
        narrow[d] = operand.shape[i]
    return operand.reshape(narrow)


def narrowed(graph: Graph, var: Any) -> tuple[Any, Any]:
    """A mask or bias var, and how to get its value before the broadcast that spread it
    over the logits: (the var to read, a function of its value giving an array of the
    logits' rank that broadcasts to them)."""
    eqn = graph.eqn(var)
    if prim(eqn) == "broadcast_in_dim" and len(eqn.invars[0].aval.shape) <= len(var.aval.shape):
        shape, dims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
        return eqn.invars[0], lambda x: _unspread(x, shape, dims)
    return var, lambda x: x


def causal(graph: Graph, mask: Any, logits_shape: tuple[int, ...]) -> bool:
    """Whether ``mask``, computed from constants, keeps exactly the positions at or before
    each query's (a lower triangle over the last two axes)."""
    if isinstance(mask, tuple):
        eqn, index = mask
        value = constant(graph, eqn.invars[index])
        if value is not None:
            with jax.ensure_compile_time_eval():
                value = np.asarray(keep_mask(mask, value))
    else:
        value = constant(graph, mask)
    parts = _lower_triangle(value, logits_shape)
    if parts is None:
        return False
    slices, tril = parts
    return all(np.array_equal(m, tril) for m in slices.astype(bool))


def _lower_triangle(value: Any, logits_shape: tuple[int, ...]) -> Any:
    """``value``'s (..., T, S) slices and the lower triangle, or None where T != S."""
    if value is None or value.ndim < 2:
        return None
    length_q, length_k = value.shape[-2], value.shape[-1]
    if (length_q, length_k) != tuple(logits_shape[-2:]) or length_q != length_k:
        return None
    return value.reshape(-1, length_q, length_k), np.tril(np.ones((length_q, length_k), bool))


def causal_bias(graph: Graph, bias: Any, logits_shape: tuple[int, ...]) -> bool:
    """Whether ``bias``, computed from constants, adds 0 at and before each query's
    position and a large negative number after it (a causal mask written as a bias)."""
    value = constant(graph, bias)
    parts = _lower_triangle(value, logits_shape)
    if parts is None:
        return False
    slices, tril = parts
    return all(np.all(b[tril] == 0) and np.all(b[~tril] <= MASK_FILL) for b in slices.astype(np.float32))
