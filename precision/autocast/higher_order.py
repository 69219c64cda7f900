"""Autocast through higher-order primitives: jit, scan, while, cond, remat,
custom_jvp, custom_vjp and shard_map.

Each sub-program is traced again under autocast (``retrace``) from the kinds
and dtypes of the values that enter it, and the primitive is bound anew with
the rewritten sub-program and its other parameters unchanged. Loops need their
carried values to enter and leave in one dtype: the body is retraced with the
carry in the dtype it comes out in until the two agree (the carry of a stack
of layers becomes half, an accumulator of losses stays float32). Custom
derivative rules run on the rewritten values: the JVP rule is the traced rule
rewritten like the function, a custom_vjp's forward is rewritten and its
backward gets cotangents cast to the dtypes of the rewritten inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend import linear_util as lu

from precision.autocast import frozen_reads, fused_attention
from precision.autocast.interpreter import Context, Rule, Site, bind, evaluate, log, outputs
from precision.autocast.program import scan_counts
from precision.autocast.regions import module_path, region_dtype, region_fp8, region_int8, region_matmul
from precision.autocast.tracing import evaluate_call
from precision.autocast.values import Kind, Val, cast, const_val

#: How the lowering picks a fused attention's branch (a name tests replace to run another platform's on a CPU).
platform_dependent = jax.lax.platform_dependent

try:  # moves constvars of a jaxpr to leading invars (remat needs a jaxpr without consts)
    from jax._src.interpreters.partial_eval import convert_constvars_jaxpr
except ImportError:  # pragma: no cover - a JAX without it fails loudly at the first remat
    convert_constvars_jaxpr = None

__all__ = ["RULES", "Spec", "retrace"]


class Spec(NamedTuple):
    """What a value entering or leaving a sub-program is: kind, dtype, shape,
    whether it is a param as read (:attr:`Val.leaf`) and whether it is computed
    from constants alone (:attr:`Val.const`)."""

    kind: Kind
    dtype: np.dtype
    shape: tuple[int, ...]
    leaf: bool = False
    const: bool = False

    @staticmethod
    def of(val: Val) -> "Spec":
        return Spec(val.kind, val.dtype, tuple(np.shape(val.array)), val.leaf, val.const)

    def key(self) -> tuple:
        return self.kind, self.dtype, self.leaf, self.const

    def val(self, array: Any, path: tuple[str, ...]) -> Val:
        """A Val of this spec holding ``array``."""
        return Val(self.kind, array, path, leaf=self.leaf, const=self.const)


def _join(a: Spec, b: Spec) -> Spec:
    """A spec both can be cast to: the wider dtype, the stronger kind."""
    dtype = a.dtype if a.dtype == b.dtype or a.dtype.itemsize >= b.dtype.itemsize else b.dtype
    return Spec(max(a.kind, b.kind), dtype, a.shape, a.leaf and b.leaf, a.const and b.const)


def retrace(jaxpr: Any, consts: Sequence[Any], in_specs: Sequence[Spec], ctx: Context,
            force: Sequence[Spec | None] | None = None) -> tuple[Any, list[Spec], list | None]:
    """Traces ``jaxpr`` under autocast for inputs of ``in_specs``.

    Returns the rewritten closed jaxpr, the specs of its outputs and its log.
    ``force`` casts chosen outputs to a given spec (loop carries, branches).
    """
    records: list | None = [] if ctx.log is not None else None
    out_specs: list[Spec] = []
    path = module_path(ctx.prefix)

    def body(*arrays):
        vals = [s.val(a, path) for s, a in zip(in_specs, arrays)]
        outs = evaluate(jaxpr, [const_val(c) for c in consts], vals, ctx.nested(ctx.prefix, records))
        if force is not None:
            outs = [o if f is None or not o.managed else Val(f.kind, o.as_dtype(f.dtype), o.path)
                    for o, f in zip(outs, force)]
        out_specs[:] = [Spec.of(o) for o in outs]
        return [o.array for o in outs]

    closed = jax.make_jaxpr(body)(*[jax.ShapeDtypeStruct(s.shape, s.dtype) for s in in_specs])
    return closed, list(out_specs), records


def _commit(ctx: Context, records: list | None) -> None:
    if ctx.log is not None and records:
        ctx.log.extend(records)


def _vals(site: Site, specs: Sequence[Spec], arrays: Sequence[Any]) -> list[Val]:
    return [s.val(a, site.path) for s, a in zip(specs, arrays)]


def _closed_parts(closed: Any) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) of a ClosedJaxpr (JAX < 0.11) or a Jaxpr with consts (JAX >= 0.11)."""
    return closed.jaxpr, closed.consts


# ----------------------------------------------------------------------------- calls


def _jit(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    if fused_attention.is_marked(site.eqn) and fused_attention.wants_fused(site.eqn, site.region):
        out = _fused_attention(site, ins, ctx)
        if out is not None:
            return out
    if frozen_reads.is_read(site.eqn):  # a weight stored in codes, dequantized
        return frozen_reads.read(site, ins)
    jaxpr, consts = _closed_parts(site.eqn.params["jaxpr"])
    if ctx.fp8.options.delayed and ctx.fp8.reachable:  # inlined: its matmuls then reach their amax histories
        return _inline(site, ins, ctx)
    if any(v.source is not None for v in ins):  # inlined: its matmuls then find a weight's codes
        return _inline(site, ins, ctx)
    closed, specs, records = retrace(jaxpr, consts, [Spec.of(v) for v in ins], ctx.at(site.scope))
    _commit(ctx, records)
    return _vals(site, specs, bind(site, [v.array for v in ins], jaxpr=closed, **_unmarked(site)))


def _unmarked(site: Site) -> dict:
    """A marked attention call rewritten as any program (a whole call, or a part a
    transformation split off): the mark has served, and its long name would be the
    name of a compiled program (and a cache file)."""
    if str(site.eqn.params.get("name", "")).startswith(fused_attention.MARK):
        return {"name": "dot_product_attention"}
    return {}


def _fused_attention(site: Site, ins: list[Val], ctx: Context) -> list[Val] | None:
    """A ``jax.nn.dot_product_attention`` call made again for the platform it is lowered
    for: with query, key and value in the region's compute dtype, cuDNN's fused attention on
    CUDA and the Pallas flash attention on a TPU (where each can take it), the traced (XLA)
    attention rewritten op by op elsewhere (see :mod:`precision.autocast.fused_attention`);
    ``None`` where neither kernel can be built."""
    names = fused_attention.argument_names(site.eqn)
    arrays = [v.as_dtype(site.region if name in fused_attention.QKV else var.aval.dtype) if v.managed else v.array
              for name, v, var in zip(names, ins, site.eqn.invars, strict=True)]
    if "bias" in names:  # cuDNN takes a bias in the operands' dtype; a -1e9 mask bias saturates, never inf
        i = names.index("bias")
        arrays[i] = cast(arrays[i], site.region, saturate=True)
    kernels, _ = fused_attention.fused_kernels(names, fused_attention.call_static(site.eqn), arrays,
                                               cudnn=fused_attention.wants_cudnn(site.eqn, site.region),
                                               module=site.path)
    if not kernels:
        return None
    jaxpr, consts = _closed_parts(site.eqn.params["jaxpr"])
    closed, _, records = retrace(jaxpr, consts, [Spec.of(v) for v in ins], ctx.at(site.scope))
    _commit(ctx, records)

    fused_outs = jax.eval_shape(next(iter(kernels.values())), *arrays)

    def elsewhere(_, traced_args):  # in the kernels' output dtypes: every branch gives one type
        outs = bind(site, traced_args, jaxpr=closed, **_unmarked(site))
        return [o.astype(want.dtype) for o, want in zip(outs, fused_outs, strict=True)]

    branches = {platform: (lambda fused, _, kernel=kernel: kernel(*fused)) for platform, kernel in kernels.items()}
    results = platform_dependent(arrays, [v.array for v in ins], default=elsewhere, **branches)
    log(ctx, site, site.region, f"fused attention ({fused_attention.where_fused(kernels)})")
    return outputs(site, results, Kind.HALF)


def _inline(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    params = site.eqn.params
    closed = params.get("call_jaxpr", params.get("jaxpr"))
    jaxpr, consts = _closed_parts(closed)
    return evaluate(jaxpr, [const_val(c) for c in consts], ins, ctx.at(site.scope))


def _remat(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    params = site.eqn.params
    closed, specs, records = retrace(params["jaxpr"], (), [Spec.of(v) for v in ins], ctx.at(site.scope))
    _commit(ctx, records)
    consts = list(closed.consts)
    prevent_cse = params["prevent_cse"]
    if isinstance(prevent_cse, tuple):
        prevent_cse = (True,) * len(consts) + prevent_cse
    out = bind(site, [*consts, *(v.array for v in ins)], jaxpr=convert_constvars_jaxpr(closed.jaxpr),
               prevent_cse=prevent_cse)
    return _vals(site, specs, out)


# ----------------------------------------------------------------------------- loops and branches


def _loop_body(jaxpr: Any, consts: Sequence[Any], fixed: list[Spec], carry: list[Spec], rest: list[Spec],
               ctx: Context) -> tuple[Any, list[Spec], list[Spec], list | None]:
    """Retraces a loop body ``(fixed, carry, rest) -> (carry, outs)`` until the carry
    leaves in the kind and dtype it enters with; returns the jaxpr, the carry
    specs, all output specs and the log."""
    n = len(carry)
    for _ in range(3):
        closed, out_specs, records = retrace(jaxpr, consts, [*fixed, *carry, *rest], ctx)
        leaving = [Spec(o.kind, o.dtype, c.shape) for o, c in zip(out_specs[:n], carry)]
        if [s.key() for s in leaving] == [s.key() for s in carry]:
            return closed, carry, out_specs, records
        carry = leaving
    carry = [_join(c, Spec(o.kind, o.dtype, c.shape)) for c, o in zip(carry, out_specs[:n])]
    force = [*carry, *[None] * (len(out_specs) - n)]
    closed, out_specs, records = retrace(jaxpr, consts, [*fixed, *carry, *rest], ctx, force=force)
    return closed, carry, out_specs, records


def _scan(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    params = site.eqn.params
    n_consts, n_carry = scan_counts(params)
    specs = [Spec.of(v) for v in ins]
    fixed, carry = specs[:n_consts], specs[n_consts:n_consts + n_carry]
    xs = [s._replace(shape=s.shape[1:]) for s in specs[n_consts + n_carry:]]
    jaxpr, consts = _closed_parts(params["jaxpr"])
    closed, carry, out_specs, records = _loop_body(jaxpr, consts, fixed, carry, xs, ctx.at(site.scope))
    _commit(ctx, records)
    args = [v.array for v in ins[:n_consts]]
    args += [v.as_dtype(c.dtype) for v, c in zip(ins[n_consts:n_consts + n_carry], carry)]
    args += [v.array for v in ins[n_consts + n_carry:]]
    return _vals(site, out_specs, bind(site, args, jaxpr=closed))


def _while(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    params = site.eqn.params
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    specs = [Spec.of(v) for v in ins]
    cond_consts, body_consts, carry = specs[:nc], specs[nc:nc + nb], specs[nc + nb:]
    inner = ctx.at(site.scope)
    body_jaxpr, body_c = _closed_parts(params["body_jaxpr"])
    body, carry, _, records = _loop_body(body_jaxpr, body_c, body_consts, carry, [], inner)
    cond_jaxpr, cond_c = _closed_parts(params["cond_jaxpr"])
    cond, _, cond_records = retrace(cond_jaxpr, cond_c, [*cond_consts, *carry], inner)
    _commit(ctx, records)
    _commit(ctx, cond_records)
    args = [v.array for v in ins[:nc + nb]] + [v.as_dtype(c.dtype) for v, c in zip(ins[nc + nb:], carry)]
    return _vals(site, carry, bind(site, args, cond_jaxpr=cond, body_jaxpr=body))


def _cond(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    index, operands = ins[0], ins[1:]
    specs = [Spec.of(v) for v in operands]
    inner = ctx.at(site.scope)
    traced = [retrace(*_closed_parts(b), specs, inner) for b in site.eqn.params["branches"]]
    joined = list(traced[0][1])
    for _, outs, _ in traced[1:]:
        joined = [_join(a, b) for a, b in zip(joined, outs)]
    branches = []
    for branch, (closed, outs, records) in zip(site.eqn.params["branches"], traced):
        if [s.key() for s in outs] != [s.key() for s in joined]:
            closed, outs, records = retrace(*_closed_parts(branch), specs, inner, force=joined)
        branches.append(closed)
        _commit(ctx, records)
    return _vals(site, joined, bind(site, [index.array, *(v.array for v in operands)], branches=tuple(branches)))


# ----------------------------------------------------------------------------- custom derivatives


def _custom_call(site: Site, ins: list[Val], ctx: Context) -> tuple[dict, int, list, Any, list, Context]:
    """The parts shared by custom_jvp and custom_vjp: the primal program
    rewritten, and a context (no logging) for their derivative rules."""
    params = site.eqn.params
    specs = [Spec.of(v) for v in ins]
    inner = ctx.at(site.scope)
    call, out_specs, records = retrace(*_closed_parts(params["call_jaxpr"]), specs, inner)
    _commit(ctx, records)
    return params, params["num_consts"], specs, call, out_specs, inner.nested(inner.prefix, None)


def _custom_jvp(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    params, n, specs, call, out_specs, quiet = _custom_call(site, ins, ctx)
    thunk = params["jvp_jaxpr_fun"]

    def jvp(*xs):
        half = len(xs) // 2
        primals, tangents = xs[n:half], xs[half + n:]
        zeros = [type(t) is SymbolicZero for t in tangents]
        jvp_jaxpr, jvp_consts, out_zeros = thunk.call_wrapped(*zeros)
        vals = [s.val(x, ()) for s, x in zip(specs[n:], primals)]
        vals += [Val(s.kind, t, ()) for s, t, z in zip(specs[n:], tangents, zeros) if not z]
        outs = evaluate(jvp_jaxpr, [const_val(c) for c in jvp_consts], vals, quiet)
        out_primals = [o.as_dtype(s.dtype) if o.managed else o.array
                       for o, s in zip(outs[:len(out_zeros)], out_specs)]
        nonzero = iter(outs[len(out_zeros):])
        out_tangents = [SymbolicZero(jax.typeof(p).to_tangent_aval()) if z else _tangent(next(nonzero), p)
                        for p, z in zip(out_primals, out_zeros)]
        return [*out_primals, *out_tangents]

    placeholder = lu.wrap_init(_never_called, debug_info=thunk.debug_info)
    bind_params = site.eqn.primitive.get_bind_params({**params, "call_jaxpr": call, "jvp_jaxpr_fun": placeholder})
    bind_params["subfuns"] = (bind_params["subfuns"][0], lu.wrap_init(jvp, debug_info=thunk.debug_info))
    return _vals(site, out_specs, site.eqn.primitive.bind(*(v.array for v in ins), **bind_params))


def _tangent(val: Val, primal: Any) -> Any:
    return val.as_dtype(primal.dtype) if val.managed and jnp.issubdtype(primal.dtype, jnp.floating) else val.array


def _never_called(*args):  # pragma: no cover - replaced before binding
    raise AssertionError("autocast: the original custom_jvp rule was called")


def _custom_vjp(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    params, n, specs, call, out_specs, quiet = _custom_call(site, ins, ctx)
    thunk, bwd = params["fwd_jaxpr_thunk"], params["bwd"]
    primal_specs = specs[n:]

    def fwd(*nonzeros):
        fwd_jaxpr, fwd_consts = thunk.call_wrapped(*nonzeros)
        n_res = len(fwd_jaxpr.outvars) - len(out_specs)
        closed, _, _ = retrace(fwd_jaxpr, fwd_consts, primal_specs, quiet, force=[None] * n_res + out_specs)
        return closed.jaxpr, closed.consts

    region, region_fp8_ = region_dtype(site.scope, ctx.root), region_fp8(site.scope, ctx.root_fp8)
    matmul, int8 = region_matmul(site.scope, ctx.root_matmul), region_int8(site.scope, ctx.root_int8)

    def new_bwd(*args):  # the user's backward, itself under autocast (its decisions not logged)
        vals, _, flat = evaluate_call(bwd.call_wrapped, args, {}, dataclasses.replace(
            ctx.nested((), None), root=region, root_fp8=region_fp8_, root_matmul=matmul, root_int8=int8))
        out = flat.unflatten(vals)
        with_logs = isinstance(out, tuple)  # JAX >= 0.11: (cts, logs), logs possibly None
        cts, logs = out if with_logs else (out, None)
        cts = [_cast_cotangent(ct, s.dtype) for ct, s in zip(cts, primal_specs, strict=True)]
        return (cts, logs) if with_logs else cts

    new = {**params, "call_jaxpr": call, "fwd_jaxpr_thunk": lu.wrap_init(fwd, debug_info=thunk.debug_info),
           "bwd": lu.wrap_init(new_bwd, debug_info=bwd.debug_info)}
    bind_params = site.eqn.primitive.get_bind_params(new)
    return _vals(site, out_specs, site.eqn.primitive.bind(*(v.array for v in ins), **bind_params))


def _cast_cotangent(ct: Any, dtype: np.dtype) -> Any:
    """A cotangent in the dtype of its (rewritten) primal input."""
    if isinstance(ct, Val):
        return ct.as_dtype(dtype) if ct.managed and jnp.issubdtype(ct.dtype, jnp.floating) else ct.array
    aval = getattr(ct, "aval", None)
    if type(ct).__name__ in ("Zero", "SymbolicZero") and aval is not None:
        if aval.dtype != dtype and jnp.issubdtype(aval.dtype, jnp.floating):
            return type(ct)(aval.update(dtype=dtype))
        return ct
    if hasattr(ct, "dtype") and ct.dtype != dtype and jnp.issubdtype(ct.dtype, jnp.floating):
        return ct.astype(dtype)
    return ct


# ----------------------------------------------------------------------------- shard_map


def _shard_map(site: Site, ins: list[Val], ctx: Context) -> list[Val]:
    params = site.eqn.params
    specs = [Spec.of(v) for v in ins]
    out_specs: list[Spec] = []
    inner = ctx.nested(site.scope)

    def body(*arrays):
        vals = [s.val(a, module_path(inner.prefix)) for s, a in zip(specs, arrays)]
        outs = evaluate(params["jaxpr"], [], vals, inner)
        out_specs[:] = [Spec.of(o) for o in outs]
        return tuple(o.array for o in outs)

    # Only a subset of the mesh axes manual needs axis_names (JAX 0.10.0 rejects axis_names=None
    # and names the param manual_axes).
    manual = set(params.get("newly_manual_axes", params.get("manual_axes", ())) or ())
    mapped = jax.shard_map(body, mesh=params["mesh"], in_specs=tuple(params["in_specs"]),
                           out_specs=tuple(params["out_specs"]), check_vma=params.get("check_vma", True),
                           **({"axis_names": manual} if manual else {}))
    return _vals(site, out_specs, mapped(*(v.array for v in ins)))


#: The rule of each higher-order primitive (by name), for :class:`~precision.autocast.interpreter.Context`.
RULES: dict[str, Rule] = {
    "jit": _jit, "pjit": _jit,
    "closed_call": _inline, "core_call": _inline, "eval_jaxpr": _inline, "call": _inline,
    "remat2": _remat, "checkpoint": _remat,
    "scan": _scan, "while": _while, "cond": _cond,
    "custom_jvp_call": _custom_jvp, "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
}
