"""The autocast interpreter: evaluates a traced program again under a compute dtype.

``autocast(fn, "mixed_bf16")`` traces ``fn`` (with its floating inputs seen as
float32, so whatever dtypes its layers pin, the traced program is the float32
one) and evaluates the traced program again, equation by equation, deciding
for each floating value the dtype it is held in:

- **allow-listed** ops (matmuls, convolutions) run in the compute dtype;
- **deny-listed** ops (exp, log, rsqrt, sums...) run in float32, and so do the
  elementwise ops whose results only feed them (the ``x - max`` of a softmax,
  the ``x * x`` of a variance): *float32 islands*;
- every other op **follows** its inputs: half if a half value reaches it,
  float32 if an island does. An island ends where its value leaves the module
  (named scope) that computed it, or meets a matmul, so activations between
  layers are half;
- constants (literals, ``iota``, masks built from integers) take the dtype of
  what they meet, saturating instead of overflowing to inf;
- explicit upcasts written in the model (``x.astype(jnp.float32)`` of a half
  value) are honoured; explicit downcasts follow the policy.

Higher-order primitives (jit, scan, while, cond, remat, custom_jvp,
custom_vjp, shard_map) are rewritten recursively (:mod:`precision.higher_order`).
The result binds ordinary primitives on whatever trace calls it, so it works
under ``jax.grad``, ``jax.jit``, ``vmap`` and shardings; it adds only the
casts it needs, each value cast at most once per dtype.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util
from jax.extend.core import DropVar, Literal

from precision.op_lists import OpClass, OpLists
from precision.regions import module_path, region_dtype, scope_names, within

__all__ = ["Kind", "Val", "Record", "Context", "Site", "evaluate", "HIGHER_ORDER"]

F32 = np.dtype(np.float32)
_POLICY_FLOATS = frozenset({np.dtype(np.float16), np.dtype(jnp.bfloat16), F32})


class Kind(enum.IntEnum):
    """What decides a value's dtype in the rewritten program."""

    NEUTRAL = 0  # constant-like: takes the dtype of what it meets
    HALF = 1  # policy-managed: held in the region's compute dtype
    FULL = 2  # a float32 island
    KEEP = 3  # not managed (integers, keys, float64, fp8): passes untouched


class Record(NamedTuple):
    """One decision of autocast, for :func:`precision.explain`."""

    path: tuple[str, ...]  # module path (named scopes) of the op
    primitive: str
    dtype: np.dtype  # the dtype the op computed in
    reason: str


# Reasons an op computed in float32 (or as traced).
DENIED = "deny-listed op"
STATISTICS = "feeds a deny-listed op"
FOLLOWS_F32 = "follows a float32 value"
UPCAST = "explicit upcast in the model"
REGION = "float32 region (a rule)"
AS_TRACED = "kept as traced (dtype-sensitive op)"


def is_policy_float(dtype: Any) -> bool:
    """float16, bfloat16 or float32: the dtypes a policy manages."""
    try:
        return np.dtype(dtype) in _POLICY_FLOATS
    except TypeError:
        return False


def _cast(x: Any, dtype: np.dtype, saturate: bool) -> Any:
    """``x`` in ``dtype``; ``saturate`` clips to the finite range instead of overflowing."""
    if saturate and jnp.finfo(dtype).max < jnp.finfo(x.dtype).max:
        bound = float(jnp.finfo(dtype).max)
        if isinstance(x, (np.ndarray, np.generic)):
            return np.asarray(np.clip(x, -bound, bound), dtype)
        x = lax.clamp(np.asarray(-bound, x.dtype), x, np.asarray(bound, x.dtype))
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype)
    return lax.convert_element_type(x, dtype)


class Val:
    """A value of the rewritten program: its kind, the module path that made it,
    and its array in one or more dtypes (casts are made once and kept)."""

    __slots__ = ("kind", "path", "array", "_casts")

    def __init__(self, kind: Kind, array: Any, path: tuple[str, ...] = (), casts: dict | None = None):
        self.kind = kind
        self.array = array
        self.path = path
        self._casts = {} if casts is None else casts

    @property
    def dtype(self) -> Any:
        dtype = self.array.dtype
        return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)

    @property
    def managed(self) -> bool:
        return self.kind is not Kind.KEEP

    def as_dtype(self, dtype: Any) -> Any:
        """The array in ``dtype`` (cast on first use; constants saturate)."""
        dtype = np.dtype(dtype)
        if not self.managed or dtype == self.dtype:
            return self.array
        if dtype not in self._casts:
            self._casts[dtype] = _cast(self.array, dtype, saturate=self.kind is Kind.NEUTRAL)
        return self._casts[dtype]

    def retag(self, kind: Kind, path: tuple[str, ...] | None = None) -> "Val":
        """The same array (and casts) under another kind or path."""
        return Val(kind, self.array, self.path if path is None else path, self._casts)


def make_val(array: Any, kind: Kind = Kind.HALF, path: tuple[str, ...] = ()) -> Val:
    """A Val for an input array: ``kind`` if it is a policy float, KEEP otherwise."""
    return Val(kind if is_policy_float(getattr(array, "dtype", None)) else Kind.KEEP, array, path)


@dataclasses.dataclass(frozen=True)
class Context:
    """What every equation's rule needs: the root compute dtype, the op lists,
    the scope of the enclosing equation, and where to log decisions."""

    root: np.dtype
    ops: OpLists
    prefix: tuple[str, ...] = ()
    log: list | None = None

    def at(self, prefix: tuple[str, ...], log: Any = ...) -> "Context":
        return dataclasses.replace(self, prefix=prefix, log=self.log if log is ... else log)


@dataclasses.dataclass
class Site:
    """One equation being rewritten, with where it sits."""

    eqn: Any
    scope: tuple[str, ...]
    path: tuple[str, ...]
    region: np.dtype
    demanded: bool  # its floating outputs only feed float32 ops

    @property
    def name(self) -> str:
        return self.eqn.primitive.name


Rule = Callable[[Site, list[Val], Context], list[Val]]
#: Rules for higher-order primitives, filled in by :mod:`precision.higher_order`.
HIGHER_ORDER: dict[str, Rule] = {}


def binders(jaxpr: Any) -> list[Any]:
    """Constvars then invars (``Jaxpr.all_invars`` where JAX has it)."""
    return list(jaxpr.all_invars) if hasattr(jaxpr, "all_invars") else [*jaxpr.constvars, *jaxpr.invars]


def literal_val(lit: Any) -> Val:
    array = np.asarray(lit.val, lit.aval.dtype) if hasattr(lit.aval, "dtype") else lit.val
    return make_val(array, Kind.NEUTRAL)


def evaluate(jaxpr: Any, consts: Sequence[Val], args: Sequence[Val], ctx: Context) -> list[Val]:
    """Evaluates ``jaxpr`` under autocast on the current trace; returns output Vals."""
    env: dict[Any, Val] = {}
    for var, val in zip(binders(jaxpr), [*consts, *args], strict=True):
        env[var] = val
    demanded = demanded_vars(jaxpr, [v.kind for v in [*consts, *args]], ctx)
    here = module_path(ctx.prefix)

    def read(var: Any, consumer: tuple[str, ...]) -> Val:
        if isinstance(var, Literal):
            return literal_val(var)
        val = env[var]
        if val.kind is Kind.FULL and not within(consumer, val.path):
            return val.retag(Kind.HALF)  # an island ends where its value leaves its module
        return val

    for eqn in jaxpr.eqns:
        scope = ctx.prefix + scope_names(eqn.source_info.name_stack)
        path = module_path(scope)
        site = Site(eqn, scope, path, region_dtype(scope, ctx.root),
                    any(v in demanded for v in eqn.outvars if not isinstance(v, DropVar)))
        ins = [read(v, path) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outs = rewrite_eqn(site, ins, ctx)
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = val if val.path == path else val.retag(val.kind, path)
    return [read(v, here) for v in jaxpr.outvars]


def static_kinds(jaxpr: Any, in_kinds: Sequence[Kind], ctx: Context) -> tuple[dict, dict]:
    """The kind each variable will have, worked out without binding anything
    (sub-programs count as half): (kinds, module path of each producer)."""
    kinds: dict[Any, Kind] = dict(zip(binders(jaxpr), in_kinds))
    paths: dict[Any, tuple[str, ...]] = {v: module_path(ctx.prefix) for v in kinds}
    for eqn in jaxpr.eqns:
        path = module_path(ctx.prefix + scope_names(eqn.source_info.name_stack))
        ins = []
        for v in eqn.invars:
            kind = Kind.NEUTRAL if isinstance(v, Literal) else kinds[v]
            if kind is Kind.FULL and not isinstance(v, Literal) and not within(path, paths[v]):
                kind = Kind.HALF
            ins.append(kind)
        managed = [k for k in ins if k is not Kind.KEEP]
        name, cls = eqn.primitive.name, ctx.ops.classify(eqn.primitive.name)
        outs = [v for v in eqn.outvars if not isinstance(v, DropVar)]
        if all(k is Kind.NEUTRAL for k in managed):
            out = [Kind.NEUTRAL] * len(outs)
        elif cls is OpClass.EACH and len(outs) == len(ins):
            out = ins
        elif name == "convert_element_type":
            src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.params["new_dtype"])
            upcast = is_policy_float(src) and is_policy_float(dst) and dst.itemsize > src.itemsize
            out = [Kind.FULL if upcast else ins[0] if src == dst else Kind.HALF]
        else:
            full = cls is OpClass.DENY or (cls is OpClass.FOLLOW and Kind.FULL in managed)
            out = [Kind.FULL if full else Kind.HALF] * len(outs)
        for v, kind in zip(outs, out):
            kinds[v] = kind if is_policy_float(v.aval.dtype) else Kind.KEEP
            paths[v] = path
    return kinds, paths


def demanded_vars(jaxpr: Any, in_kinds: Sequence[Kind], ctx: Context) -> set:
    """Floating variables every use of which computes in float32.

    Walks the equations backwards: a deny-listed op demands float32 operands,
    and so does a follow op (or a convert) that computes in float32: because
    its own outputs are demanded, or because another operand is a float32
    island. So ``reduce_sum(x * x)`` squares in float32, ``x - max`` of a
    softmax subtracts in float32, while ``x``, also used by half ops, stays half.
    Demand stays inside the module that consumes: a norm does not make the
    module feeding it compute in float32.
    """
    kinds, paths = static_kinds(jaxpr, in_kinds, ctx)
    uses: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        uses.update(v for v in eqn.invars if not isinstance(v, Literal))
    uses.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
    demand: collections.Counter = collections.Counter()
    demanded: set = set()
    for eqn in reversed(jaxpr.eqns):
        outs = [v for v in eqn.outvars if not isinstance(v, DropVar) and is_policy_float(v.aval.dtype)]
        all_demanded = bool(outs) and all(uses[v] and demand[v] == uses[v] for v in outs)
        if all_demanded:
            demanded.update(outs)
        name = eqn.primitive.name
        cls = ctx.ops.classify(name)
        floats = [v for v in eqn.invars if not isinstance(v, Literal) and is_policy_float(v.aval.dtype)]
        path = module_path(ctx.prefix + scope_names(eqn.source_info.name_stack))
        if cls is OpClass.FOLLOW or name == "convert_element_type":
            island = any(kinds[v] is Kind.FULL and within(path, paths[v]) for v in floats)
            demanding = all_demanded or island
        else:
            demanding = cls is OpClass.DENY
        if demanding:  # within a module: a module's inputs are not computed in float32 for it
            demand.update(v for v in floats if within(path, paths[v]))
    return demanded


def log(ctx: Context, site: Site, dtype: np.dtype, reason: str) -> None:
    if ctx.log is not None:
        ctx.log.append(Record(site.path, site.name, np.dtype(dtype), reason))


def outputs(site: Site, results: Any, kind: Kind) -> list[Val]:
    """Vals for an equation's results: policy floats get ``kind``, the rest KEEP."""
    if not site.eqn.primitive.multiple_results:
        results = [results]
    return [Val(kind if is_policy_float(r.dtype) else Kind.KEEP, r, site.path) for r in results]


def bind(site: Site, args: Sequence[Any], **param_updates: Any) -> Any:
    return site.eqn.primitive.bind(*args, **{**site.eqn.params, **param_updates})


def rewrite_eqn(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    """Rewrites one equation under the policy; returns its output Vals."""
    rule = HIGHER_ORDER.get(site.name)
    if rule is not None:
        return rule(site, ins, ctx)
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
    if cls is OpClass.EACH:
        results = bind(site, [v.array for v in ins])
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
        return outputs(site, _bind_in(site, ins, F32), Kind.FULL)
    if site.demanded or any(v.kind is Kind.FULL for v in floats):
        log(ctx, site, F32, STATISTICS if site.demanded else FOLLOWS_F32)
        return outputs(site, _bind_in(site, ins, F32), Kind.FULL)
    if site.region == F32 and ctx.root != F32:
        log(ctx, site, F32, REGION)
    return outputs(site, _bind_in(site, ins, site.region), Kind.HALF)


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


def _bind_in(site: Site, ins: list[Val], dtype: np.dtype) -> Any:
    """Binds the equation with every managed operand in ``dtype``."""
    args = [v.as_dtype(dtype) if v.managed else v.array for v in ins]
    updates = {}
    jaxpr = site.eqn.params.get("update_jaxpr")
    if jaxpr is not None and any(v.managed and v.as_dtype(dtype).dtype != var.aval.dtype
                                 for v, var in zip(ins, site.eqn.invars)):
        updates = _retyped_update_jaxpr(jaxpr, site.eqn.params.get("update_consts", ()), dtype)
    return bind(site, args, **updates)


def _retyped_update_jaxpr(jaxpr: Any, consts: Sequence[Any], dtype: np.dtype) -> dict:
    """A scatter's scalar combiner traced again for ``dtype`` operands."""
    n = len(jaxpr.invars)
    scalar = jax.ShapeDtypeStruct((), dtype)
    closed = jax.make_jaxpr(lambda *xs: jax.core.eval_jaxpr(jaxpr, list(consts), *xs))(*[scalar] * n)
    return {"update_jaxpr": closed.jaxpr, "update_consts": tuple(closed.consts)}


def _allowed(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    """A matmul or convolution: operands in the region's compute dtype."""
    params = site.eqn.params
    traced_in = {np.dtype(v.aval.dtype) for v in site.eqn.invars if is_policy_float(v.aval.dtype)}
    preferred = params.get("preferred_element_type")
    target = site.region
    if site.region == F32 and ctx.root != F32:
        log(ctx, site, F32, REGION)
    else:
        log(ctx, site, target, "allow-listed op")
    keep_wide = (preferred is not None and np.dtype(preferred) == F32 and traced_in
                 and all(d != F32 for d in traced_in))  # the model asked for a float32 result of half operands
    args = [v.as_dtype(target) if v.managed else v.array for v in ins]
    updates = {}
    if "preferred_element_type" in params and preferred is not None:
        updates["preferred_element_type"] = F32 if keep_wide else target
    result = bind(site, args, **updates)
    return outputs(site, result, Kind.FULL if keep_wide and target != F32 else Kind.HALF)


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


def const_val(c: Any) -> Val:
    """Consts of a traced program: closed-over tracers are data, concrete arrays constants."""
    return make_val(c, Kind.HALF if isinstance(c, jax.core.Tracer) else Kind.NEUTRAL)
