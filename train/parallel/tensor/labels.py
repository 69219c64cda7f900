"""How one equation carries a split dimension (or a param's dimensions) from its operands to
its results: the transfer rules of the tensor-parallel finder (:mod:`.finder`).

A *label* says an activation is split over ``tensor`` along one dimension (the features a
column-parallel matmul made, then heads); a *view* says a value is a param, moved (each of
its dimensions is a dimension of the param, or None where it was broadcast). Each rule
returns the labels of the results, or a :class:`Stop` saying why the split cannot pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from train.parallel.tensor.dims import through_reshape

__all__ = ["Label", "View", "Stop", "ELEMENTWISE", "REDUCTIONS", "moved_view", "moved_label"]

#: Ops computing each element from the elements at the same place of their operands.
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "neg", "exp", "exp2", "log", "log1p", "expm1",
    "tanh", "logistic", "erf", "erfc", "erf_inv", "sqrt", "rsqrt", "cbrt", "abs", "sign", "square", "sin", "cos",
    "tan", "atan2", "select_n", "convert_element_type", "stop_gradient", "copy", "copy_p", "reduce_precision",
    "clamp", "and", "or", "not", "xor", "eq", "ne", "lt", "le", "gt", "ge", "is_finite", "floor", "ceil", "round",
    "rem", "nextafter", "optimization_barrier", "sharding_constraint", "real", "imag"})
#: Reductions over the dimensions their ``axes`` name.
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "reduce_and",
                        "reduce_or", "reduce_xor"})


class Label(NamedTuple):
    """An activation split over ``tensor`` along ``dim``; ``group``: the matmul pair(s) it belongs to;
    ``parts``: the split features are a fused matmul's parts (q, k and v), each split on its own."""

    dim: int
    group: int
    parts: int = 1


class View(NamedTuple):
    """A param as a value holds it: ``dims[i]`` is the param dimension the value's dimension
    ``i`` is (None: a dimension broadcast in)."""

    path: tuple[str, ...]
    dims: tuple[int | None, ...]


class Stop(NamedTuple):
    """The split cannot pass this equation: why."""

    why: str


def moved_view(eqn: Any, view: View) -> View | None:
    """The view of the result of an op that only moves a param's values (None: not a move
    this finder follows)."""
    name, p = eqn.primitive.name, eqn.params
    shape_in = tuple(eqn.invars[0].aval.shape)
    shape_out = tuple(eqn.outvars[0].aval.shape)
    if name in ("convert_element_type", "copy", "copy_p", "optimization_barrier", "sharding_constraint",
                "reduce_precision"):
        return view
    if name == "transpose":
        return View(view.path, tuple(view.dims[d] for d in p["permutation"]))
    if name == "broadcast_in_dim":
        dims: list = [None] * len(shape_out)
        for i, d in enumerate(p["broadcast_dimensions"]):
            dims[d] = view.dims[i] if shape_in[i] == shape_out[d] else None
        return View(view.path, tuple(dims))
    if name == "squeeze":
        return View(view.path, tuple(d for i, d in enumerate(view.dims) if i not in p["dimensions"]))
    if name == "reshape":
        return _reshaped_view(view, shape_in, shape_out)
    return None


def _reshaped_view(view: View, before: tuple[int, ...], after: tuple[int, ...]) -> View | None:
    """A reshape adding or removing size-1 dimensions only (a bias made ``(1, 1, N)``)."""
    kept_in = [(d, n) for d, n in zip(view.dims, before) if n != 1]
    real_out = [n for n in after if n != 1]
    if [n for _, n in kept_in] != real_out:
        return None
    it = iter(d for d, _ in kept_in)
    return View(view.path, tuple(next(it) if n != 1 else None for n in after))


def moved_label(eqn: Any, label: Label) -> Label | Stop:
    """The label of the result of a one-operand op that moves or maps values (transpose,
    broadcast, squeeze, reshape, reductions over other dimensions)."""
    name, p, d = eqn.primitive.name, eqn.params, label.dim
    shape_in = tuple(eqn.invars[0].aval.shape)
    shape_out = tuple(eqn.outvars[0].aval.shape)
    if name == "transpose":
        return label._replace(dim=list(p["permutation"]).index(d))
    if name == "broadcast_in_dim":
        return label._replace(dim=p["broadcast_dimensions"][d])
    if name == "squeeze":
        if d in p["dimensions"]:
            return Stop("squeezes the split dimension")
        return label._replace(dim=d - sum(1 for a in p["dimensions"] if a < d))
    if name == "reshape":
        through = through_reshape(shape_in, shape_out, d)
        return Stop(f"reshapes the split features {shape_in} -> {shape_out}") if through.dim is None \
            else label._replace(dim=through.dim)
    if name in REDUCTIONS:
        axes = tuple(p["axes"])
        if d in axes:
            return Stop(f"{name} over the split features")
        return label._replace(dim=d - sum(1 for a in axes if a < d))
    if name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
        return Stop(f"{name} along the split features") if p["axis"] == d else label
    if name in ("rev",):
        return Stop("reverses the split features") if d in p["dimensions"] else label
    if name == "pad":
        low, high, interior = p["padding_config"][d]
        return Stop("pads the split features") if (low, high, interior) != (0, 0, 0) else label
    return Stop(f"{name} on split features")
