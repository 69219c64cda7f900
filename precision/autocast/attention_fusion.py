"""Softmax attention written out, computed as one fused attention call.

The interpreter asks :func:`plan` which of a program's equations form a softmax
attention to fuse (:mod:`.attention_pattern` finds them): in a half-precision
region, unless the op lists turn it off, where cuDNN's fused attention can be
built for its shapes (that needs JAX's CUDA plugin, not a GPU) or the TPU's
Pallas flash attention can compute it (that needs libtpu, not a TPU:
:mod:`.tpu_attention`). :func:`emit` then makes the attention's result for the
platform the program is lowered for, as :mod:`.fused_attention` does for
``jax.nn.dot_product_attention`` calls: ``jax.lax.platform_dependent`` holds
cuDNN's fused attention for CUDA and the Pallas kernel for TPU (query, key and
value in the region's dtype, in the ``(batch, length, heads, head size)`` layout;
the mask, bias, scale and causality found) and, for every other platform, the
pattern's own equations rewritten op by op, exactly as without fusion. All give
the region's dtype.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from precision.autocast import fused_attention, tpu_attention
from precision.autocast.attention_masks import Graph, keep_mask, narrowed, prim
from precision.autocast.attention_pattern import Attention, describe, find_attention, near_misses
from precision.autocast.regions import module_path, region_dtype, scope_names
from precision.autocast.values import Kind, Record, Val, cast

__all__ = ["Fusion", "plan", "emit", "ATTENTION", "outermost"]

#: The primitive name explain's attention records carry.
ATTENTION = "attention"
_HALF = (np.dtype(np.float16), np.dtype(jnp.bfloat16))

#: How the lowering picks a branch (a name tests replace to run the CUDA branch on a CPU).
platform_dependent = jax.lax.platform_dependent


@dataclasses.dataclass(frozen=True)
class Fusion:
    """An attention to fuse: the pattern, its compute dtype, its fused calls by platform
    (``cuda``: cuDNN's, ``tpu``: the Pallas flash attention), and the vars its mask and bias
    are read from (before their broadcast), with how."""

    attention: Attention
    dtype: np.dtype
    kernels: dict[str, Callable]  # platform -> the fused call, a function of the operands giving its outputs
    reads: dict  # role -> (var, function of its value giving the fused call's operand)


def plan(jaxpr: Any, consts: dict, ctx: Any) -> dict[int, Fusion]:
    """The attentions of ``jaxpr`` to fuse, by the index of their last equation. Logs,
    per module, each attention fused and each one left as it is, with why."""
    if ctx.log is None and not ctx.ops.fuse_attention:
        return {}
    try:
        found, missed = find_attention(jaxpr, consts), near_misses(jaxpr)
    except Exception as e:  # noqa: BLE001 - an optimisation never fails a model: it runs as written
        warnings.warn(f"autocast: looking for softmax attention to fuse failed ({type(e).__name__}: {e}); "
                      f"the model's attention runs as written. Please report this.", RuntimeWarning, stacklevel=2)
        return {}
    chosen: dict[int, Fusion] = {}
    graph = Graph(jaxpr, consts)  # one for every attention of the program
    for att in found:
        path, dtype = _where(jaxpr, att, ctx)
        why = _why_not(att, dtype, ctx)
        fusion, how = (None, f"not fused: {why}") if why is not None else _fusion(graph, att, dtype, path)
        if fusion is not None:
            chosen[att.last] = fusion
        _log(ctx, path, dtype, how)
    for index, why in missed:
        path, dtype = _where(jaxpr, None, ctx, index)
        _log(ctx, path, dtype, f"not fused: {why}")
    return chosen


def outermost(jaxpr: Any, att: Attention) -> Any:
    """The attention's equation in the outermost scope: its module's (not an einsum's inside it)."""
    return min((jaxpr.eqns[i] for i in sorted(att.eqns)), key=lambda e: len(scope_names(e.source_info.name_stack)))


def _where(jaxpr: Any, att: Attention | None, ctx: Any, index: int | None = None) -> tuple[tuple, np.dtype]:
    first = outermost(jaxpr, att) if att is not None else jaxpr.eqns[index]
    scope = ctx.prefix + scope_names(first.source_info.name_stack)
    return module_path(scope), np.dtype(region_dtype(scope, ctx.root))


def _why_not(att: Attention, dtype: np.dtype, ctx: Any) -> str | None:
    if not ctx.ops.fuse_attention:
        return "fused attention is off (fuse_attention=False)"
    if dtype not in _HALF:
        return f"it computes in {dtype.name} (cuDNN's fused attention takes float16 or bfloat16)"
    if not fused_attention._cudnn_capable():
        return "this host's GPU is older than cuDNN's fused attention (compute capability 8.0)"
    return None


def _cuda_plugin() -> bool:
    return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))


def _cannot_build() -> str:
    if not _cuda_plugin():
        return ("cuDNN's fused attention cannot be described here: JAX's CUDA plugin is not installed "
                "(a GPU install has it)")
    return "cuDNN's fused attention cannot take its shapes, head size, mask or bias"


def _how(att: Attention, kernels: dict, tpu_why: str) -> str:
    """What explain says of an attention: fused, and by which kernels where a TPU's is
    described here (libtpu installed), or why not. A platform whose toolkit is not installed
    goes unsaid, unless nothing is: a CPU-only install says cuDNN's could not be described."""
    cuda_why = "" if "cuda" in kernels else _cannot_build()
    names = {"cuda": "cuDNN for CUDA", "tpu": f"{tpu_attention.KERNEL} for TPU"}
    whys = {"cuda": cuda_why if _cuda_plugin() or not tpu_attention.available() else "", "tpu": tpu_why}
    if not kernels:
        return "not fused: " + "; ".join(
            why if p == "cuda" else f"{names[p]}: {why}" for p, why in whys.items() if why)
    if not tpu_attention.available():
        return describe(att)
    return "; ".join([describe(att) + " by " + " and ".join(names[p] for p in names if p in kernels)] +
                     [f"not by {names[p]}: {why}" for p, why in whys.items() if why])


def _log(ctx: Any, path: tuple, dtype: np.dtype, reason: str) -> None:
    if ctx.log is not None:
        ctx.log.append(Record(path, ATTENTION, dtype, reason))


def _fusion(graph: Graph, att: Attention, dtype: np.dtype, path: tuple = ()) -> tuple[Fusion | None, str]:
    """The fused calls for ``att`` in ``dtype`` (built abstractly), by platform, and what
    explain says of them; no fusion where no kernel can take it. ``path``: the module it is in."""
    logits = _logits_shape(graph.jaxpr, att)
    heads = att.q_dims[3] is not None
    reads: dict = {}
    for role, var in (("query", att.query), ("key", att.key), ("value", att.value)):
        dims = getattr(att, {"query": "q_dims", "key": "k_dims", "value": "v_dims"}[role])
        var = var if role == "query" else _before_repeat(graph, var, dims[3])
        reads[role] = (var, lambda x, dims=dims: _to_btnh(x, dims))
    if att.bias is not None:
        var, widen = narrowed(graph, att.bias)
        reads["bias"] = (var, lambda x, widen=widen: _logits_4d(cast(widen(x), dtype, saturate=True), logits,
                                                              len(att.q_dims[0]), heads))
    if att.mask is not None:
        if isinstance(att.mask, tuple):
            eqn, index = att.mask
            var, widen = eqn.invars[index], lambda x: keep_mask(att.mask, x, narrow=True)
        else:
            var, spread = narrowed(graph, att.mask)
            widen = lambda x, spread=spread: spread(x).astype(bool)  # noqa: E731
        reads["mask"] = (var, lambda x, widen=widen: _logits_4d(widen(x), logits, len(att.q_dims[0]), heads))
    specs = {}
    for role, (var, make) in reads.items():
        held = dtype if role in fused_attention.QKV or role == "bias" else var.aval.dtype
        specs[role] = jax.eval_shape(make, jax.ShapeDtypeStruct(var.aval.shape, held))
    static = {"scale": att.scale, "is_causal": att.is_causal}
    kernels, tpu_why = fused_attention.fused_kernels(tuple(specs), static, list(specs.values()), module=path)
    return (Fusion(att, dtype, kernels, reads) if kernels else None), _how(att, kernels, tpu_why)


def _before_repeat(graph: Graph, var: Any, heads: int | None) -> Any:
    """The key or value ``var`` before its heads were repeated for grouped-query attention
    (``jnp.repeat(x, groups, axis=heads)``: a broadcast to a new axis after the heads, reshaped
    into them, as Hugging Face's Llama writes it), else ``var``. The fused call takes the
    grouped heads as they are (query head ``n`` reads key head ``n // groups``, as the repeat
    made it): the cache is read once, where its repeated copy was written and read again."""
    reshape = graph.eqn(var)
    if heads is None or prim(reshape) != "reshape" or reshape.params.get("dimensions") is not None:
        return var
    broadcast = graph.eqn(reshape.invars[0])
    if prim(broadcast) != "broadcast_in_dim":
        return var
    source, rank = broadcast.invars[0], len(var.aval.shape)
    kept = tuple(d for d in range(rank + 1) if d != heads + 1)
    shape, spread = tuple(source.aval.shape), tuple(broadcast.outvars[0].aval.shape)
    if len(shape) != rank or tuple(broadcast.params["broadcast_dimensions"]) != kept or \
            tuple(spread[d] for d in kept) != shape:
        return var
    merged = (*shape[:heads], shape[heads] * spread[heads + 1], *shape[heads + 1:])
    return source if tuple(var.aval.shape) == merged else var


def _logits_shape(jaxpr: Any, att: Attention) -> tuple[int, ...]:
    dots = [i for i in att.eqns if jaxpr.eqns[i].primitive.name == "dot_general"]
    return jaxpr.eqns[min(dots)].outvars[0].aval.shape


def _layout(shape: tuple[int, ...], dims: tuple) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The permutation taking an operand to (batch..., length, heads, head size), the
    batch sizes, and the heads' size (1 when it has no heads dim)."""
    batch, length, size, heads = dims
    rest = tuple(d for d in batch if d != heads)
    perm = (*rest, length, *((heads,) if heads is not None else ()), size)
    return perm, tuple(shape[d] for d in rest), (shape[heads] if heads is not None else 1)


def _to_btnh(x: Any, dims: tuple) -> Any:
    perm, rest, heads = _layout(x.shape, dims)
    y = jnp.transpose(x, perm)
    return y.reshape((math.prod(rest), y.shape[len(rest)], heads, y.shape[-1]))


def _logits_4d(x: Any, logits: tuple[int, ...], n_batch: int, heads: bool) -> Any:
    """A mask or bias that broadcasts to the logits (batch..., T, S) as the fused call's
    (B or 1, N or 1, T, S): batch and heads stay 1 where they were."""
    x = jnp.asarray(x)
    x = x.reshape((1,) * (len(logits) - x.ndim) + x.shape)
    n_rest = n_batch - 1 if heads else n_batch
    target = list(x.shape)
    if n_rest > 1 and math.prod(x.shape[:n_rest]) != 1:
        target[:n_rest] = logits[:n_rest]
    target[-2:] = logits[-2:]
    x = jnp.broadcast_to(x, target)
    return x.reshape((math.prod(target[:n_rest]), target[n_rest] if heads else 1, *logits[-2:]))


def _from_btnh(out: Any, att: Attention) -> Any:
    """The fused call's (B, T, N, H) result in the layout the pattern made."""
    _, rest, _ = _layout(att.query.aval.shape, att.q_dims)
    y = out.reshape((*rest, *out.shape[1:]))
    names = [f"B{i}" for i in range(len(rest))] + ["T"] + (
        [f"B{len(rest)}"] if att.q_dims[3] is not None else []) + ["H"]
    if att.q_dims[3] is None:
        y = y.reshape((*y.shape[:-2], y.shape[-1]))
    return jnp.transpose(y, [names.index(n) for n in att.out_order])


def emit(fusion: Fusion, read: Callable[[Any], Val], op_by_op: Callable[[], Val], path: tuple[str, ...]) -> Val:
    """The attention's result: its fused call where the program is lowered for a platform
    that has one (cuDNN's for CUDA, the Pallas flash attention for TPU), ``op_by_op()`` (the
    pattern's equations rewritten as without fusion) elsewhere."""
    dtype = fusion.dtype
    operands = {}
    for role, (var, _) in fusion.reads.items():
        val = read(var)
        held = dtype if role in fused_attention.QKV else var.aval.dtype
        operands[role] = val.as_dtype(held) if val.managed else val.array

    def fused(kernel):
        def run(given):
            args = [make(given[role]) for role, (_, make) in fusion.reads.items()]
            return _from_btnh(kernel(*args)[0], fusion.attention).astype(dtype)
        return run

    def elsewhere(_):
        return op_by_op().as_dtype(dtype)

    branches = {platform: fused(kernel) for platform, kernel in fusion.kernels.items()}
    return Val(Kind.HALF, platform_dependent(operands, default=elsewhere, **branches), path)
