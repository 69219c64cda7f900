"""The axes a program's matmuls contract each of its arguments over.

A weight stored in 8 bits with one scale per *output channel* has a scale for each slice
along the axes its matmul does not contract: the rounding of each output of the matmul
then depends on one scale only, and the scale is applied to the operand the matmul reads
(or to its result) without mixing channels. Which axes those are, a weight's shape does
not say: a Flax ``Dense`` kernel is ``(in, out)``, a Hugging Face GPT-2 ``Conv1D`` kernel
``(out, in)`` read transposed, a tied embedding is gathered by rows and multiplied by
its transpose. :func:`contracted_axes` reads it off the traced program.

A use is followed through ops that only move or retype the array (``convert``, ``copy``,
``transpose``) and into sub-programs (jit, remat, custom_jvp/vjp, scan: a scanned
weight's slice loses its leading axis, which is therefore never contracted). Each
``dot_general`` reading it contracts some of its axes; a ``gather`` of its rows (an
embedding lookup) reads whole slices along the axes it does not index, which count as
contracted (one scale per row). Any other use (arithmetic, a reshape, an output) leaves
the array without an answer: it is not a matmul's weight.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from precision.reads import _inner_binders

__all__ = ["contracted_axes", "read_axes"]

_RETYPES = frozenset({"convert_element_type", "copy", "copy_p", "optimization_barrier", "sharding_constraint"})
_OTHER = "other"

Axes = tuple  # an array's axes as the original argument's (None: an axis it does not have)


def contracted_axes(fn: Callable[[Any], Any], tree: Any, lookups: bool = True, matmuls: bool = True) -> Any:
    """For each array of ``tree``, the sorted tuple of its axes that the matmuls and
    lookups of ``fn(tree)`` read it over (contract, or take whole per looked-up row), or
    None where it has another use or none. Uses that disagree give the union of their
    axes. ``lookups=False``: a lookup is another use (only matmuls' weights get axes);
    ``matmuls=False``: a matmul is (only tables that are only looked up get axes).
    Traces ``fn`` abstractly (nothing is computed)."""
    return read_axes(fn, tree, [(lookups, matmuls)])[0]


def read_axes(fn: Callable[[Any], Any], tree: Any, reads: list[tuple[bool, bool]]) -> list[Any]:
    """:func:`contracted_axes` of ``fn`` for each ``(lookups, matmuls)`` of ``reads``, from one trace."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    closed = jax.make_jaxpr(lambda *xs: fn(jax.tree_util.tree_unflatten(treedef, list(xs))))(*avals)
    trees = []
    for read in reads:
        out = []
        for var, leaf in zip(closed.jaxpr.invars, leaves, strict=True):
            uses = _uses(closed.jaxpr, var, tuple(range(np.ndim(leaf))), tuple(read))
            out.append(None if not uses or _OTHER in uses else tuple(sorted(set().union(*uses))))
        trees.append(jax.tree_util.tree_unflatten(treedef, out))
    return trees


def _uses(jaxpr: Any, var: Any, axes: Axes, reads: tuple[bool, bool]) -> list:
    """What each use of ``var`` (whose axes are the argument's ``axes``) reads it over: a set
    of the argument's axes per matmul or lookup, :data:`_OTHER` for any other use (``reads``:
    whether lookups, matmuls count as reads)."""
    found: list = [_OTHER for v in jaxpr.outvars if v is var]
    for eqn in jaxpr.eqns:
        positions = [i for i, v in enumerate(eqn.invars) if v is var]
        if not positions:
            continue
        name = eqn.primitive.name
        if name in _RETYPES and positions == [0]:
            found += _uses(jaxpr, eqn.outvars[0], axes, reads)
        elif name == "transpose":
            found += _uses(jaxpr, eqn.outvars[0], tuple(axes[p] for p in eqn.params["permutation"]), reads)
        elif name == "dot_general" and len(positions) == 1 and reads[1]:
            contracting, _ = eqn.params["dimension_numbers"]
            side = contracting[positions[0]] if positions[0] < 2 else ()
            found.append({axes[a] for a in side} - {None})
        elif name == "gather" and positions == [0] and reads[0]:
            indexed = set(eqn.params["dimension_numbers"].collapsed_slice_dims)
            found.append({a for i, a in enumerate(axes) if i not in indexed} - {None})
        else:
            found += _inside(jaxpr, eqn, positions, axes, reads)
        if _OTHER in found:
            return found
    return found


def _inside(jaxpr: Any, eqn: Any, positions: list[int], axes: Axes, reads: tuple[bool, bool]) -> list:
    """The uses of an operand passed into ``eqn``'s sub-programs, and of what they return
    of it unchanged (a jit's output that is its input, moved)."""
    inner = _inner_binders(eqn, positions)
    if not inner:
        return [_OTHER]
    found: list = []
    for sub, binder, sliced in inner:
        uses = _uses(sub, binder, axes[1:] if sliced else axes, reads)
        exits = [k for k, v in enumerate(sub.outvars) if v is binder]
        found += [u for u in uses if u is not _OTHER] + [_OTHER] * (uses.count(_OTHER) - len(exits))
        if exits and (eqn.primitive.name in ("scan", "while") or len(sub.outvars) != len(eqn.outvars)):
            found.append(_OTHER)
        elif exits:
            found += [u for k in exits for u in _uses(jaxpr, eqn.outvars[k], axes, reads)]
    return found
