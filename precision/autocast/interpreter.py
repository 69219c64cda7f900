"""The autocast interpreter: evaluates a traced program again under a compute dtype.

It walks the equations of a program traced in float32 (:mod:`.tracing`) and
binds each one again, deciding for each floating value the dtype it is held in
(its :class:`~precision.autocast.values.Kind`):

- **allow-listed** ops (matmuls, convolutions) run in the compute dtype;
- **deny-listed** ops (exp, log, rsqrt, sums...) run in float32, and so do the
  elementwise ops whose results only feed them (:mod:`.islands`): *float32
  islands*;
- every other op **follows** its inputs: half if a half value reaches it,
  float32 if an island does. An island ends where its value leaves the module
  (named scope) that computed it, or meets a matmul, so activations between
  layers are half;
- constants (literals, ``iota``, masks built from integers) take the dtype of
  what they meet, saturating instead of overflowing to inf;
- explicit upcasts written in the model (``x.astype(jnp.float32)`` of a half
  value) are honoured; explicit downcasts follow the policy;
- matmuls and convolutions left in float32 get the precision the module's
  policy asks for (:mod:`.matmul_precision`: ``matmul=highest``, not TF32).

Higher-order primitives (jit, scan, while, cond, remat, custom_jvp,
custom_vjp, shard_map) are rewritten by the rules the context carries
(:mod:`.higher_order`). The result binds ordinary primitives on whatever trace
calls it, so it works under ``jax.grad``, ``jax.jit``, ``vmap`` and shardings;
it adds only the casts it needs, each value cast at most once per dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import DropVar, Literal

from precision.autocast.derivatives import HALF_WITH_FLOAT32_DERIVATIVE
from precision.autocast.context import Context, Site, site_of
from precision.autocast.islands import demanded_vars
from precision.autocast.leaves import keeps_leaf, moves_a_leaf
from precision.autocast.op_lists import OpClass
from precision.autocast.program import MATMUL_PRIMITIVES, binders, retyped_update_jaxpr
from precision.autocast.scaled import int8_norm, int8_sites
from precision.autocast.scaled.dispatch import not_scaled, scaled_product
from precision.autocast import (attention_fusion, frozen_reads, matmul_precision, norm_fusion, projection_split,
                                reductions)
from precision.autocast.regions import module_path, scope_names, within
from precision.autocast.split_sums import SplitSums, wider_sums
from precision.autocast.values import (AS_TRACED, DENIED, F32, FOLLOWS_F32, REGION, STATISTICS, UPCAST, Kind, Record,
                                       Val, is_policy_float, literal_val)

__all__ = ["Context", "Site", "Rule", "evaluate", "bind", "log", "outputs"]


#: How a higher-order primitive is rewritten: (site, input Vals, context) -> output Vals.
Rule = Callable[[Site, list[Val], Context], list[Val]]


def evaluate(jaxpr: Any, consts: Sequence[Val], args: Sequence[Val], ctx: Context, top: bool = False) -> list[Val]:
    """Evaluates ``jaxpr`` under autocast on the current trace; returns output Vals (``top``: the model's
    program, whose outputs its caller takes in the dtypes traced)."""
    env: dict[Any, Val] = {}
    for var, val in zip(binders(jaxpr), [*consts, *args], strict=True):
        env[var] = val
    demanded = demanded_vars(jaxpr, [v.kind for v in [*consts, *args]], ctx.prefix, ctx.ops)
    known = {var: val.array for var, val in zip(jaxpr.constvars, consts) if val.const}
    fusions = attention_fusion.plan(jaxpr, known, ctx)
    fused = {i for f in fusions.values() for i in f.attention.eqns}
    norms, later = norm_fusion.plan(jaxpr, known, ctx, fused)
    fused |= {i for n in norms.values() for i in n.eqns} | {j for js in later.values() for j in js}
    splits = projection_split.plan(jaxpr, fused, ctx.ops.split_projections)
    fused |= {i for s in splits.values() for i in s.eqns}
    hints, biased = int8_sites.plan(jaxpr, fused, top) if ctx.root_int8 else ({}, {})  # biased: {add: its product}
    fused |= set(biased.values())
    for i, eqn in enumerate(jaxpr.eqns):
        if i in fusions:
            _fuse(jaxpr, fusions[i], env, demanded, ctx)
        elif i in norms:
            _fuse_norm(jaxpr, norms[i], env, demanded, ctx)
            for j in later[i]:
                _run(jaxpr.eqns[j], env, demanded, ctx)
        elif i in splits:
            _split(jaxpr, splits[i], env, demanded, ctx)
        elif i in biased:
            _with_bias(jaxpr, biased[i], i, env, demanded, ctx, hints.get(biased[i], {}))
        elif i not in fused:
            _run(eqn, env, demanded, ctx, hints.get(i, {}))
    return [_read(env, v, module_path(ctx.prefix)) for v in jaxpr.outvars]


def _read(env: dict, var: Any, consumer: tuple[str, ...]) -> Val:
    if isinstance(var, Literal):
        return literal_val(var)
    val = env[var]
    if val.kind is Kind.FULL and not within(consumer, val.path):
        return val.retag(Kind.HALF)  # an island ends where its value leaves its module
    return val


def _run(eqn: Any, env: dict, demanded: set, ctx: Context, hints: dict | None = None, bias: list | None = None
         ) -> None:
    """Rewrites ``eqn`` reading its operands from ``env`` and writing its results there (``hints``: an int8
    product's, :func:`.int8_sites.plan`; ``bias``: ``[Val]`` it adds itself, emptied where it does)."""
    site = site_of(eqn, demanded, ctx)
    path = site.path
    if hints or bias is not None:
        site = int8_sites.hinted(site, hints or {}, bias, lambda var: _read(env, var, path))
    ins = [_read(env, v, path) for v in eqn.invars]
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        outs = rewrite_eqn(site, ins, ctx)
        frozen_reads.follow(site, ins, outs)  # a weight stored in codes, moved or cast: still made from them
        frozen_reads.lookup(site, ins, outs)  # rows of a table in codes: from their codes alone
    leaf, const = keeps_leaf(site, ins), all(v.const for v in ins)
    for val in outs:
        val.leaf = val.leaf or leaf  # a param reshaped, cast or sliced is still a param as a layer reads it
        val.const = const
    for var, val in zip(eqn.outvars, outs, strict=True):
        if not isinstance(var, DropVar):
            env[var] = val if val.path == path else val.retag(val.kind, path)


def _fuse(jaxpr: Any, fusion: Any, env: dict, demanded: set, ctx: Context) -> None:
    """Makes a softmax attention's result as one fused call (:mod:`.attention_fusion`);
    where the program is not lowered for CUDA, its equations rewritten one by one."""
    att = fusion.attention
    last = attention_fusion.outermost(jaxpr, att)  # named for its module
    path = module_path(ctx.prefix + scope_names(last.source_info.name_stack))

    def op_by_op() -> Val:
        local = dict(env)
        records: list | None = None if ctx.log is None else []
        for i in sorted(att.eqns):
            _run(jaxpr.eqns[i], local, demanded, ctx.at(ctx.prefix, records))
        if records:  # its other decisions were logged as the fused attention's; its products' say why
            ctx.log.extend(r for r in records if r.primitive in MATMUL_PRIMITIVES)  # they are not fp8/int8
        return local[att.out]

    name_stack = source_info_util.current_name_stack() + last.source_info.name_stack
    with source_info_util.user_context(last.source_info.traceback, name_stack=name_stack):
        env[att.out] = attention_fusion.emit(fusion, lambda var: _read(env, var, path), op_by_op, path)


def _split(jaxpr: Any, split: Any, env: dict, demanded: set, ctx: Context) -> None:
    """A fused projection's parts (:mod:`.projection_split`): one product each on a TPU."""
    dot = site_of(jaxpr.eqns[split.dot], demanded, ctx)
    if not projection_split.applies(split, env, dot.fp8):  # as written; an int8 product adding its bias itself
        biased = ctx.root_int8 and split.add is not None
        if biased:
            _with_bias(jaxpr, split.dot, split.add, env, demanded, ctx, {})
        for i in sorted(split.eqns - ({split.dot, split.add} if biased else set())):
            _run(jaxpr.eqns[i], env, demanded, ctx)
        return

    def as_written(log: Any) -> list[Val]:
        local = {var: env[var].apart() for var in (split.x, split.w, split.bias) if var is not None}
        for i in sorted(split.eqns):
            _run(jaxpr.eqns[i], local, demanded, ctx.at(ctx.prefix, log))
        return [local[var] for var in split.outs]

    def rewritten(index: int, ins: list[Val], bias: Val | None = None) -> tuple[Val, bool]:
        eqn = jaxpr.eqns[index]
        site = dataclasses.replace(site_of(eqn, demanded, ctx), bias=None if bias is None else [bias])
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            return rewrite_eqn(site, ins, ctx.at(ctx.prefix, None))[0], site.bias == []

    bias_in_product = (dot.int8 and split.add is not None
                       and _bias_holder(site_of(jaxpr.eqns[split.add], demanded, ctx), env[split.bias]) is not None)
    made = projection_split.emit(jaxpr, split, env, as_written, rewritten, ctx.log, dot.int8, bias_in_product)
    env.update(made if made is not None else dict(zip(split.outs, as_written(ctx.log))))


def _with_bias(jaxpr: Any, dot: int, add: int, env: dict, demanded: set, ctx: Context, hints: dict) -> None:
    """A projection and the add of its bias (:func:`.int8_sites.bias_epilogues`): an int8 product adds the
    bias itself; any other, or an add in float32, runs both equations as written."""
    eqn = jaxpr.eqns[add]
    site = site_of(eqn, demanded, ctx)
    bias_var = next(v for v in eqn.invars if v is not jaxpr.eqns[dot].outvars[0])
    holder = _bias_holder(site, _read(env, bias_var, site.path))
    _run(jaxpr.eqns[dot], env, demanded, ctx, hints, holder)
    if holder:  # not taken
        _run(eqn, env, demanded, ctx)
        return
    made = env[jaxpr.eqns[dot].outvars[0]]
    env[eqn.outvars[0]] = made.retag(made.kind, site.path)


def _bias_holder(add: Site, bias: Val) -> list | None:
    """``[bias]`` for an int8 product to add itself (emptied where it does), where the model's ``add``
    of it would be a half one; None where it would be in float32 (the product then leaves it)."""
    return [bias] if bias.kind is Kind.HALF and not add.demanded else None


def _fuse_norm(jaxpr: Any, norm: Any, env: dict, demanded: set, ctx: Context) -> None:
    """Makes a norm's result (layer, RMS, batch) with its backward in closed form (:mod:`.norm_fusion`):
    its forward is its equations rewritten one by one, their decisions logged once."""
    last = jaxpr.eqns[norm.last]
    logged: list[bool] = []

    def op_by_op(given: dict) -> dict:
        local = {**env, **given}
        here = ctx if not logged else ctx.at(ctx.prefix, None)  # traced again for the gradient: logged once
        logged.append(True)
        for i in sorted(norm.eqns):
            _run(jaxpr.eqns[i], local, demanded, here)
        return local

    name_stack = source_info_util.current_name_stack() + last.source_info.name_stack
    with source_info_util.user_context(last.source_info.traceback, name_stack=name_stack):
        env.update(norm_fusion.emit(norm, lambda var: env[var], op_by_op))
    row = int8_norm.row_norm(norm) if ctx.root_int8 else None
    if row is not None and env[norm.x].kind is Kind.HALF:  # an int8 product reading it may normalize x itself
        params = tuple(env[v] for v in (norm.scale, norm.offset) if v is not None)
        env[norm.out].normalized = int8_norm.Normalized(row, env[norm.x], params)


def log(ctx: Context, site: Site, dtype: np.dtype, reason: str) -> None:
    """Records a decision (for explain) when the context collects them."""
    if ctx.log is not None:
        ctx.log.append(Record(site.path, site.name, np.dtype(dtype), reason))


def outputs(site: Site, results: Any, kind: Kind) -> list[Val]:
    """Vals for an equation's results: policy floats get ``kind``, the rest KEEP."""
    if not site.eqn.primitive.multiple_results:
        results = [results]
    return [Val(kind if is_policy_float(r.dtype) else Kind.KEEP, r, site.path) for r in results]


def bind(site: Site, args: Sequence[Any], **param_updates: Any) -> Any:
    """Binds the site's primitive again on ``args``, its params updated (a float32
    matmul's precision raised to the site's, :mod:`.matmul_precision`)."""
    return site.eqn.primitive.bind(*args, **_params(site, args, param_updates))


def _params(site: Site, args: Sequence[Any], updates: dict) -> dict:
    params = {**site.eqn.params, **updates}
    return {**params, **matmul_precision.update(site.name, params, args, site.matmul)}


def rewrite_eqn(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    """Rewrites one equation under the policy; returns its output Vals."""
    rule = ctx.rules.get(site.name)
    if rule is not None:
        return rule(site, ins, ctx)
    if ctx.reduce is not None and moves_a_leaf(site, ins):
        return [_moved_leaf(site, ins)]
    if site.name == "convert_element_type":
        return [_convert(site, ins[0], ctx)]
    cls = ctx.ops.classify(site.name)
    if site.eqn.params.get("out_dtype") is not None:  # mul(..., out_dtype=): mixed dtypes by design
        cls = OpClass.ORIGINAL
    floats = [v for v in ins if v.managed]
    unmanaged_float = any(not v.managed and jnp.issubdtype(v.dtype, jnp.floating) for v in ins
                          if hasattr(v.array, "dtype"))
    if all(v.kind is Kind.NEUTRAL for v in floats):
        return outputs(site, _bind_as_traced(site, ins), Kind.NEUTRAL)
    if cls is OpClass.EACH:  # a sharding constraint on a half activation holds its half cast (a layout's gather)
        results = bind(site, [v.as_dtype(site.region) if site.name == "sharding_constraint" and v.kind is Kind.HALF
                              and not v.leaf else v.array for v in ins])
        results = results if site.eqn.primitive.multiple_results else [results]
        if len(results) == len(ins):
            return [Val(v.kind, r, site.path) for v, r in zip(ins, results)]
        cls = OpClass.ORIGINAL
    if cls is OpClass.ORIGINAL or unmanaged_float:
        return _as_traced(site, ins, ctx)
    if cls is OpClass.ALLOW:
        return _allowed(site, ins, ctx)
    if cls is OpClass.DENY:
        log(ctx, site, F32, DENIED)
        return outputs(site, _bind_in(site, ins, F32, ctx.reduce), Kind.FULL)
    if site.demanded or any(v.kind is Kind.FULL for v in floats):
        log(ctx, site, F32, STATISTICS if site.demanded else FOLLOWS_F32)
        return outputs(site, _bind_in(site, ins, F32, ctx.reduce), Kind.FULL)
    if site.region == F32 and ctx.root != F32:
        log(ctx, site, F32, REGION)
    if site.name in HALF_WITH_FLOAT32_DERIVATIVE and site.region != F32 and not site.eqn.params:
        (x,) = ins  # erf, erfc: half here, their derivative's exp in float32 (deny-listed in both passes)
        return outputs(site, HALF_WITH_FLOAT32_DERIVATIVE[site.name](x.as_dtype(site.region)), Kind.HALF)
    return outputs(site, _bind_in(site, ins, site.region, ctx.reduce), Kind.HALF)


def bind_reducing(site: Site, ins: list[Val], args: Sequence[Any], reduce_dtype: Any, split: SplitSums = SplitSums(),
                  **param_updates: Any) -> Any:
    """:func:`bind` on ``args`` (the arrays of ``ins``), the gradients of the leaves
    (params) a half matmul, broadcast, gather or broadcasting elementwise op
    reads produced in ``reduce_dtype`` (:mod:`.reductions`: the dtype a data-parallel
    reduction runs in); ``split``: its sums split across devices (:mod:`.split_sums`)."""
    leaves = [v.leaf and v.managed for v in ins]
    applies = reductions.applies(site.eqn.primitive, args, leaves, reduce_dtype)
    if not applies and split == SplitSums():
        return bind(site, args, **param_updates)
    sources = [v.array if leaf and applies else None for v, leaf in zip(ins, leaves)]
    cotangent = None if split.forward is None else np.dtype(args[0].dtype)
    return reductions.bind(site.eqn.primitive, args, sources, _params(site, args, param_updates),
                           reduce_dtype if applies else None, input_grad=split.backward, cotangent=cotangent)


def _moved_leaf(site: Site, ins: list[Val]) -> Val:
    """Under a ``reduce_dtype``, a param is moved in its own dtype and cast where an op
    reads it: the op then hands its gradient back in that dtype, unrounded
    (:mod:`.reductions`). A narrowing cast is left to that op."""
    head = ins[0]
    if site.name == "convert_element_type":
        return head
    return Val(head.kind, bind(site, [v.array for v in ins]), site.path, leaf=True)


def _bind_as_traced(site: Site, ins: list[Val]) -> Any:
    return bind(site, [v.as_dtype(var.aval.dtype) if v.managed else v.array
                       for v, var in zip(ins, site.eqn.invars)])


def _as_traced(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    """Runs an op exactly as traced: operands in their traced dtypes."""
    results = _bind_as_traced(site, ins)
    out = outputs(site, results, Kind.FULL)
    out = [v.retag(Kind.HALF) if v.kind is Kind.FULL and v.dtype != F32 else v for v in out]
    if any(v.kind is Kind.FULL for v in out):
        log(ctx, site, F32, AS_TRACED)
    return out


def _bind_in(site: Site, ins: list[Val], dtype: np.dtype, reduce_dtype: Any = None) -> Any:
    """Binds the equation with every managed operand in ``dtype`` (its gradients in
    ``reduce_dtype``, see :func:`bind_reducing`)."""
    args = [v.as_dtype(dtype) if v.managed else v.array for v in ins]
    updates = {}
    jaxpr = site.eqn.params.get("update_jaxpr")
    if jaxpr is not None and any(v.managed and v.as_dtype(dtype).dtype != var.aval.dtype
                                 for v, var in zip(ins, site.eqn.invars)):
        updates = retyped_update_jaxpr(jaxpr, site.eqn.params.get("update_consts", ()), dtype)
    return bind_reducing(site, ins, args, reduce_dtype, **updates)


def _allowed(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    """A matmul or convolution: operands in the region's compute dtype."""
    params = site.eqn.params
    traced_in = {np.dtype(v.aval.dtype) for v in site.eqn.invars if is_policy_float(v.aval.dtype)}
    preferred = params.get("preferred_element_type")
    target = site.region
    keep_wide = (preferred is not None and np.dtype(preferred) == F32 and traced_in
                 and all(d != F32 for d in traced_in))  # the model asked for a float32 result of half operands
    split = wider_sums(site.name, site.scope, target)
    wide = F32 if keep_wide else split.forward or target  # the dtype of its result
    kind = Kind.FULL if wide != target else Kind.HALF
    out = F32 if site.f32_result and site.int8 else wide  # an int8 product writes the program's float32 output
    result, dtype, why = scaled_product(site, ins, ctx, out, split.backward)
    if result is not None:  # FP8 or int8
        log(ctx, site, dtype, why)
        return outputs(site, result, Kind.FULL if out != target else kind)
    if site.region == F32 and (ctx.root != F32 or ctx.root_fp8 or ctx.root_int8) and not (site.fp8 or site.int8):
        log(ctx, site, F32, REGION)
    else:
        log(ctx, site, target, why or not_scaled(ctx, site))
    args = [v.as_dtype(target) if v.managed else v.array for v in ins]
    updates = {}
    if ("preferred_element_type" in params and preferred is not None) or wide != target:
        updates["preferred_element_type"] = wide
    frozen = frozen_reads.product(site, ins, args, _params(site, args, updates), ctx.reduce)  # a weight in codes
    if frozen is not None:
        return outputs(site, frozen, kind)
    return outputs(site, bind_reducing(site, ins, args, ctx.reduce, split, **updates), kind)


def _convert(site: Site, v: Val, ctx: Context) -> Val:
    """``convert_element_type``: upcasts in the model are honoured, downcasts follow the policy."""
    src = np.dtype(site.eqn.invars[0].aval.dtype)
    dst = np.dtype(site.eqn.params["new_dtype"])
    if not (v.managed and is_policy_float(src) and is_policy_float(dst)):
        if v.managed:
            arg = v.array if not is_policy_float(dst) else v.as_dtype(src)
        else:
            arg = v.array
        result = bind(site, [arg])
        if not is_policy_float(result.dtype):
            return Val(Kind.KEEP, result, site.path)
        if v.managed or not jnp.issubdtype(v.dtype, jnp.floating):
            return Val(Kind.NEUTRAL if v.kind in (Kind.NEUTRAL, Kind.KEEP) else v.kind, result, site.path)
        return Val(Kind.FULL if result.dtype == F32 else Kind.HALF, result, site.path)  # from fp8 / f64
    if src == dst:
        return v
    if v.kind is Kind.NEUTRAL:
        return Val(Kind.NEUTRAL, v.as_dtype(dst), site.path)
    if site.demanded:
        log(ctx, site, F32, STATISTICS)
        return Val(Kind.FULL, v.as_dtype(F32), site.path)
    if dst.itemsize > src.itemsize:
        log(ctx, site, dst, UPCAST)
        return Val(Kind.FULL, v.as_dtype(dst), site.path)
    return Val(Kind.HALF, v.as_dtype(site.region), site.path)
