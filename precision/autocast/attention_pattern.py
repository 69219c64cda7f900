"""Softmax attention written out, found in a traced program.

Most Flax models do not call ``jax.nn.dot_product_attention``: Flax's own
``dot_product_attention`` (Linen and NNX, and the modules that call it) and the
attention of Hugging Face's Flax models are written out as two products around
a softmax. :func:`find_attention` recognises that pattern among a program's
equations, in any layout:

    logits = dot_general(q, k)          batch dims (batch..., heads), q's free dim T, k's S,
                                        q and k contracting over the head dim; q may be
                                        scaled by a constant first
    logits = logits * c | logits / c    (constants; any number, either side)
    logits = logits + bias              (a bias not computed from the logits)
    logits = where(mask, logits, -big)  (``select_n``, bare or in ``jnp.where``'s jit)
    probs  = softmax(logits, axis=-1)   (written out: max, sub, exp, sum, div)
    out    = dot_general(probs, v)      (either operand order), then a transpose, maybe

and describes it as one ``jax.nn.dot_product_attention`` call (:class:`Attention`).
It is the same computation only when nothing else reads its inside: every value
between the two products (the logits, the probabilities, the softmax's sums) has
no use outside the pattern, so probabilities a model returns, sows or drops out
(dropout reads them) keep the pattern from matching, and :func:`near_misses` says
why for ``explain``. Masks computed from constants alone (``nn.make_causal_mask``,
``jnp.tril``) are evaluated: a causal one becomes ``is_causal``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import numpy as np
from jax.extend.core import Literal

from precision.autocast.attention_masks import (MASK_FILL, Graph, causal, causal_bias, constant, is_where, narrowed, prim,
                                                where_parts)

__all__ = ["Attention", "find_attention", "near_misses", "describe"]


@dataclasses.dataclass(frozen=True)
class Attention:
    """One softmax attention among a program's equations, as ``jax.nn.dot_product_attention`` sees it."""

    eqns: frozenset[int]  # the equations it replaces (indices into the program's equations)
    last: int  # where its result is made: every input exists by then
    query: Any  # vars of the program
    key: Any
    value: Any
    out: Any
    q_dims: tuple[tuple[int, ...], int, int, int | None]  # (batch dims, T, H, heads dim) of the query
    k_dims: tuple[tuple[int, ...], int, int, int | None]  # (batch dims, S, H, heads dim) of the key
    v_dims: tuple[tuple[int, ...], int, int, int | None]  # (batch dims, S, H, heads dim) of the value
    out_order: tuple[str, ...]  # the result's axes as "B0".."Bn", "N", "T", "H"
    scale: float
    bias: Any = None  # a var broadcastable to the logits, added
    mask: Any = None  # a var or (jit eqn, operand index): where the logits are kept
    is_causal: bool = False


def find_attention(jaxpr: Any, consts: dict | None = None) -> list[Attention]:
    """Every softmax attention of ``jaxpr`` (its own equations, not sub-programs);
    ``consts``: the values of its constvars that are concrete (masks folded from them)."""
    graph = Graph(jaxpr, consts)
    found = []
    for i, eqn in enumerate(jaxpr.eqns):
        if prim(eqn) == "div":
            match = _match_at(graph, i)
            if isinstance(match, Attention):
                found.append(match)
    return found


def near_misses(jaxpr: Any) -> list[tuple[int, str]]:
    """(equation index, why) for each softmax after a product that is not an attention
    to fuse (its probabilities read elsewhere, dropped out, a grouped-query layout...)."""
    graph = Graph(jaxpr)
    return [(i, why) for i, eqn in enumerate(jaxpr.eqns) if prim(eqn) == "div"
            for why in [_match_at(graph, i)] if isinstance(why, str)]


def _match_at(graph: Graph, div_index: int) -> "Attention | str | None":
    """The attention whose softmax ends at equation ``div_index``; a reason when a softmax
    between two products is there but is not one; None when there is no softmax."""
    softmax = _softmax(graph, div_index)
    if softmax is None:
        return None
    logits, group, probs = softmax
    back = _before_softmax(graph, logits, group)
    if back is None:
        return None
    qk, scale, bias, mask = back
    group.add(qk)
    forward = _after_softmax(graph, probs, group, qk)
    if isinstance(forward, str) or forward is None:
        return forward if prim(graph.jaxpr.eqns[qk]) == "dot_general" else None
    pv, v_var, out, out_order, last, v_dims = forward
    dot = graph.jaxpr.eqns[qk]
    query, key = dot.invars
    q_scale, query = _scaled(graph, query, group)
    scale *= q_scale
    q_dims, k_dims = _qk_dims(dot)
    for i in sorted(group - {last}):
        for v in graph.jaxpr.eqns[i].outvars:
            if not graph.only_used_by(v, group):
                return "its logits or probabilities are read outside the attention (returned, sown or dropped out)"
    if q_dims is None or v_dims is None:
        return "the products' layouts are not (batch..., heads, length, head size)"
    if not (_sizes(query, q_dims[0]) == _sizes(key, k_dims[0]) == _sizes(v_var, v_dims[0])):
        return "query, key and value heads differ (grouped-query attention is left as it is)"
    logits = dot.outvars[0].aval.shape
    is_causal = False
    if mask is not None and causal(graph, mask, logits):
        is_causal, mask = True, None
    if bias is not None and not is_causal and causal_bias(graph, bias, logits):
        is_causal, bias = True, None
    return Attention(frozenset(group), last, query, key, v_var, out, q_dims, k_dims, v_dims, out_order, scale,
                     bias, mask, is_causal)


def _sizes(var: Any, dims: tuple[int, ...]) -> tuple[int, ...]:
    shape = var.aval.shape
    return tuple(shape[d] for d in dims)


def _softmax(graph: Graph, i: int) -> tuple[Any, set[int], Any] | None:
    """``probs = exp(x - max(x)) / sum(exp(x - max(x)))`` over the last axis, ending at
    equation ``i``: (x, the equations, probs)."""
    eqns = graph.jaxpr.eqns
    div = eqns[i]
    e, denom = div.invars
    group = {i}
    if prim(graph.eqn(denom)) == "broadcast_in_dim":
        group.add(graph.producer[denom])
        denom = graph.eqn(denom).invars[0]
    total = graph.eqn(denom)
    if prim(total) != "reduce_sum" or total.invars[0] is not e:
        return None
    rank = len(e.aval.shape)
    if tuple(total.params["axes"]) != (rank - 1,):
        return None
    group.add(graph.producer[denom])
    exp = graph.eqn(e)
    if prim(exp) != "exp":
        return None
    group.add(graph.producer[e])
    sub = graph.eqn(exp.invars[0])
    if prim(sub) != "sub":
        return None
    group.add(graph.producer[exp.invars[0]])
    x, shift = sub.invars
    for _ in range(4):  # broadcast, stop_gradient, max with -inf: down to the reduce_max
        producer = graph.eqn(shift)
        if prim(producer) in ("broadcast_in_dim", "stop_gradient", "reshape"):
            group.add(graph.producer[shift])
            shift = producer.invars[0]
        elif prim(producer) == "max":
            group.add(graph.producer[shift])
            shift = next(v for v in producer.invars if not isinstance(v, Literal))
        else:
            break
    top = graph.eqn(shift)
    if prim(top) != "reduce_max" or top.invars[0] is not x or tuple(top.params["axes"]) != (rank - 1,):
        return None
    group.add(graph.producer[shift])
    return x, group, div.outvars[0]


def _before_softmax(graph: Graph, x: Any, group: set[int]) -> tuple[int, float, Any, Any] | None:
    """From the softmax's input back to the logits' product: (its index, constant scale,
    bias var, mask). Adds the equations passed to ``group``."""
    scale, bias, mask = 1.0, None, None
    while True:
        eqn = graph.eqn(x)
        name = prim(eqn)
        if name == "dot_general":
            return graph.producer[x], scale, bias, mask
        if name == "convert_element_type":
            group.add(graph.producer[x])
            x = eqn.invars[0]
        elif name in ("mul", "div"):
            a, b = eqn.invars
            c = constant(graph, b)
            if c is None and name == "mul":
                a, b, c = b, a, constant(graph, a)
            if c is None or c.size != 1:
                return None
            scale = scale * float(c) if name == "mul" else scale / float(c)
            group.add(graph.producer[x])
            x = a
        elif name == "add" and bias is None:
            a, b = eqn.invars
            feeds = [v for v in (a, b) if _leads_to_dot(graph, v)]
            if len(feeds) != 1:
                return None
            bias = b if feeds[0] is a else a
            group.add(graph.producer[x])
            x = feeds[0]
        elif name == "select_n" and mask is None:
            pred, on_false, on_true = eqn.invars
            fill = constant(graph, on_false)
            if fill is None or fill.size and float(np.max(fill)) > MASK_FILL:
                return None
            mask = pred
            group.add(graph.producer[x])
            x = on_true
        elif name in ("jit", "pjit") and mask is None and is_where(eqn):
            mask, logits = where_parts(graph, eqn)
            if mask is None:
                return None
            group.add(graph.producer[x])
            x = logits
        else:
            return None


def _leads_to_dot(graph: Graph, var: Any, depth: int = 0) -> bool:
    eqn = graph.eqn(var)
    if eqn is None or depth > 6:
        return False
    if prim(eqn) == "dot_general":
        return True
    if prim(eqn) in ("mul", "div", "convert_element_type"):
        return _leads_to_dot(graph, eqn.invars[0], depth + 1)
    return False


def _scaled(graph: Graph, query: Any, group: set[int]) -> tuple[float, Any]:
    """A query divided or multiplied by a constant before the product, used only there:
    (the factor, the query before it); the factor joins the attention's scale."""
    eqn = graph.eqn(query)
    if prim(eqn) not in ("mul", "div") or len(graph.uses.get(query, [])) != 1 or query in graph.outputs:
        return 1.0, query
    a, b = eqn.invars
    c = constant(graph, b)
    if c is None or c.size != 1:
        return 1.0, query
    group.add(graph.producer[query])
    return (float(c) if prim(eqn) == "mul" else 1.0 / float(c)), a


def _qk_dims(dot: Any) -> tuple[Any, Any]:
    """(batch dims, free dim, contracting dim, heads dim) of the query and of the key, from the
    logits' product; (None, None) unless each has one free and one contracting dim."""
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    lhs, rhs = dot.invars
    dims = []
    for operand, contracting, batch in ((lhs, lc, lb), (rhs, rc, rb)):
        rank = len(operand.aval.shape)
        free = [d for d in range(rank) if d not in contracting and d not in batch]
        if len(contracting) != 1 or len(free) != 1 or not batch:
            return None, None
        dims.append((tuple(batch), free[0], contracting[0], batch[-1] if len(batch) > 1 else None))
    return dims[0], dims[1]


def _after_softmax(graph: Graph, probs: Any, group: set[int], qk: int) -> Any:
    """From the probabilities to the attention's result: (the product's index, value var,
    result var, its axes, the last equation, the value's dims); a reason when the
    probabilities go elsewhere."""
    uses = graph.uses.get(probs, [])
    x = probs
    if len(uses) == 1 and prim(graph.jaxpr.eqns[uses[0]]) == "convert_element_type":
        group.add(uses[0])
        x = graph.jaxpr.eqns[uses[0]].outvars[0]
        uses = graph.uses.get(x, [])
    if probs in graph.outputs or x in graph.outputs or len(uses) != 1:
        return "its probabilities are read outside the attention (returned, sown or dropped out)"
    pv = uses[0]
    dot = graph.jaxpr.eqns[pv]
    if prim(dot) != "dot_general":
        return "its probabilities are dropped out or changed before the product with the values"
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    p_first = dot.invars[0] is x
    p_contract, v_contract = (lc, rc) if p_first else (rc, lc)
    p_batch, v_batch = (lb, rb) if p_first else (rb, lb)
    rank = len(x.aval.shape)
    if tuple(p_contract) != (rank - 1,) or tuple(p_batch) != tuple(range(rank - 2)):
        return None
    v_var = dot.invars[1] if p_first else dot.invars[0]
    v_rank = len(v_var.aval.shape)
    v_free = [d for d in range(v_rank) if d not in v_contract and d not in v_batch]
    if len(v_contract) != 1 or len(v_free) != 1:
        return None
    batch = [f"B{i}" for i in range(len(p_batch))]
    order = (*batch, "T", "H") if p_first else (*batch, "H", "T")
    group.add(pv)
    out, last = dot.outvars[0], pv
    users = graph.uses.get(out, [])
    if len(users) == 1 and prim(graph.jaxpr.eqns[users[0]]) == "transpose" and out not in graph.outputs:
        perm = graph.jaxpr.eqns[users[0]].params["permutation"]
        order = tuple(order[p] for p in perm)
        group.add(users[0])
        last = users[0]
        out = graph.jaxpr.eqns[users[0]].outvars[0]
    v_dims = (tuple(v_batch), v_contract[0], v_free[0], v_batch[-1] if len(v_batch) > 1 else None)
    return pv, v_var, out, order, last, v_dims


def describe(attention: Attention) -> str:
    """What the fused call gets, for ``explain``."""
    parts = ["causal" if attention.is_causal else "", "mask" if attention.mask is not None else "",
             "bias" if attention.bias is not None else ""]
    extra = ", ".join(p for p in parts if p)
    return f"fused attention (softmax attention written out{': ' + extra if extra else ''})"
