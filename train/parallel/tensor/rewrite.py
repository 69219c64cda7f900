"""The layout written into a model's program: a program pass (:func:`precision.program_pass`)
that evaluates the model's traced program again with the sites the finder found
(:mod:`.finder`, :mod:`.sites`), before autocast gives every value its dtype.

At each site:

- a column-parallel matmul takes its activation whole along the sequence (under sequence
  parallelism, gathered here: autocast casts it to the compute dtype first, so the gather
  moves half the bytes), its output features split over ``tensor`` (pinned), and its
  input's gradient, a sum across ``tensor``, made in ``tensor_reduce_dtype``
  (:func:`precision.split_sums`); a fused one (q, k, v in one kernel) gets its kernel in
  the order that keeps each device's heads of every part together (:mod:`.parts`: the
  step's gather of the params puts it so);
- a row-parallel matmul makes its partial product in ``tensor_reduce_dtype``, its input
  (and so, in the backward pass, its input's gradient) is pinned split, and its
  result is pinned whole over ``tensor`` (an all-reduce), or split along the sequence
  under sequence parallelism (a reduce-scatter): norms, dropout and residual adds
  between the blocks then run on each device's part of the sequence;
- a vocabulary lookup's result is pinned like a row-parallel result (the lookup's sum
  across the split vocabulary is exact in any dtype: one device holds each token);
- the split of a fused matmul's result into its parts reads them from that order.

Sub-programs (jit, remat, a scan over layers) holding sites are rewritten with them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import DropVar, Literal
from jax.sharding import NamedSharding, PartitionSpec

import precision
from precision.autocast.program import scan_counts
from train.parallel.tensor.dims import dot_roles
from train.parallel.tensor.parts import parts_of
from train.parallel.tensor.sites import Column, Embedding, Row, Unfuse

__all__ = ["Rewrite"]

U = PartitionSpec.UNCONSTRAINED


class Rewrite:
    """The sites of one program and how to pin values on ``mesh`` (``tensor`` devices;
    ``sequence``: activations between the blocks split along the sequence)."""

    def __init__(self, sites: dict, mesh: Any, tensor: int, sequence: bool, reduce_dtype: Any):
        self.sites, self.mesh, self.tensor = sites, mesh, tensor
        self.sequence, self.reduce_dtype = sequence, reduce_dtype

    def __call__(self, closed: Any, args: list) -> list:
        return self.run(closed.jaxpr, list(closed.consts), list(args), ())

    def run(self, jaxpr: Any, consts: list, args: list, loc: tuple) -> list:
        env: dict = {}
        for var, val in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True):
            env[var] = val
        inside = {site[len(loc)] for site in self.sites if site[:len(loc)] == loc and len(site) > len(loc) + 1}
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                site = self.sites.get(loc + (i,))
                if site is not None:
                    outs = self.at_site(eqn, ins, site)
                elif i in inside:
                    outs = self.into(eqn, ins, loc + (i,))
                else:
                    outs = _bind(eqn, ins)
            outs = outs if eqn.primitive.multiple_results else [outs]
            for var, val in zip(eqn.outvars, outs):
                if not isinstance(var, DropVar):
                    env[var] = val
        return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

    # ------------------------------------------------------------------ sites

    def at_site(self, eqn: Any, ins: list, site: Any) -> Any:
        if isinstance(site, Column):
            return self.column(eqn, ins, site)
        if isinstance(site, Row):
            ins = list(ins)
            x = ins[site.activation]  # its gradient pinned split too (the backward's product stays local)
            ins[site.activation] = self.pin(x, self.tokens_whole(x.ndim, site.tokens_in, site.dim))
            with precision.split_sums(self.reduce_dtype, forward=True):
                out = _bind(eqn, ins)
            return self.pin(out, self.between_blocks(out.ndim, site.tokens))
        if isinstance(site, Embedding):  # its gradient whole along the sequence: the lookup's transpose stays local
            out = _bind(eqn, ins)
            return self.pin(out, self.between_blocks(out.ndim, site.tokens), self.tokens_whole(out.ndim, site.tokens))
        if isinstance(site, Unfuse):
            parts = parts_of(ins[0], site.axis, site.parts, self.tensor)
            return parts if site.part is None else parts[site.part]
        raise TypeError(site)

    def column(self, eqn: Any, ins: list, site: Column) -> Any:
        ins = list(ins)
        x = ins[site.activation]
        roles = dot_roles(eqn, site.activation)
        free = tuple(d for d in sorted(roles) if roles[d][0] == "free")  # a fused kernel arrives interleaved
        # gathered whole along the sequence, its gradient (a sum across tensor) scattered back to the blocks' layout
        ins[site.activation] = self.pin(x, self.tokens_whole(x.ndim, free), self.between_blocks(x.ndim, free))
        with precision.split_sums(self.reduce_dtype, backward=True):
            out = _bind(eqn, ins)
        if site.head:  # a vocabulary head's logits: left to the loss (its blocks of rows, if any)
            return out
        spec = [None] * out.ndim
        spec[site.out_dim] = "tensor"
        if site.tokens:
            spec[site.tokens[0]] = U
        return self.pin(out, spec)

    @staticmethod
    def tokens_whole(rank: int, tokens: tuple[int, ...], split: int | None = None) -> list:
        """Whole along the sequence (batch left to the data axes), split along ``split`` if given."""
        spec: list = [None] * rank
        if tokens:
            spec[tokens[0]] = U
        if split is not None:
            spec[split] = "tensor"
        return spec

    def between_blocks(self, rank: int, tokens: tuple[int, ...]) -> list:
        """A row-parallel result's layout: whole over ``tensor``, or split along the sequence."""
        spec: list = [None] * rank
        if tokens:
            spec[tokens[0]] = U
        if self.sequence and len(tokens) > 1:
            spec[tokens[1]] = "tensor"
        return spec

    def pin(self, x: Any, spec: list, backward: list | None = None) -> Any:
        """``x`` in the layout ``spec``; its cotangent in ``backward``'s (default: the same)."""
        forward = NamedSharding(self.mesh, PartitionSpec(*spec))
        if backward is None or backward == spec:
            return jax.lax.with_sharding_constraint(x, forward)
        return _pinned(x, forward, NamedSharding(self.mesh, PartitionSpec(*backward)))

    # ------------------------------------------------------------------ sub-programs

    def into(self, eqn: Any, ins: list, loc: tuple) -> Any:
        """A jit, remat or scan whose body holds sites, bound again on its rewritten body."""
        name, p = eqn.primitive.name, eqn.params
        body = p["jaxpr"]
        if name in ("jit", "pjit"):  # inlined: the sites' results are the body's own
            return self.run(body.jaxpr, list(body.consts), ins, loc)
        if name in ("remat2", "checkpoint"):
            return jax.checkpoint(lambda *xs: self.run(body, [], list(xs), loc), prevent_cse=p["prevent_cse"],
                                  policy=p["policy"])(*ins)
        if name == "scan":
            return self.scan(eqn, ins, loc)
        raise TypeError(f"no sites expected inside {name}")

    def scan(self, eqn: Any, ins: list, loc: tuple) -> list:
        p, (n_consts, n_carry) = eqn.params, scan_counts(eqn.params)
        consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        body = p["jaxpr"]

        def step(c, x):
            outs = self.run(body.jaxpr, list(body.consts), [*consts, *c, *x], loc)
            return outs[:len(c)], outs[len(c):]

        c, ys = jax.lax.scan(step, carry, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return [*c, *ys]


def _pinned(x: Any, forward: NamedSharding, backward: NamedSharding) -> Any:
    """``x`` in ``forward``'s layout, its cotangent in ``backward``'s: a gather along the sequence
    whose transpose is a reduce-scatter (Megatron-SP's g), or a reduce-scatter whose transpose
    is a gather."""

    @jax.custom_vjp
    def pinned(x):
        return jax.lax.with_sharding_constraint(x, forward)

    pinned.defvjp(lambda x: (pinned(x), None), lambda _, g: (jax.lax.with_sharding_constraint(g, backward),))
    return pinned(x)


def _bind(eqn: Any, ins: list) -> Any:
    return eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))


def transformed(fn: Callable, rewrite_of: Callable[[Any], Rewrite | None]) -> Callable:
    """``fn`` traced and evaluated again through ``rewrite_of(its program)``'s sites."""
    def traced(*xs):
        closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in xs])
        rewrite = rewrite_of(closed)
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs) if rewrite is None else rewrite(closed, xs)

    return traced
