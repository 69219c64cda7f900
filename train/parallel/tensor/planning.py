"""A model's tensor-parallel plan, found in its traced program (:mod:`.finder`) and
overridden per param path by ``sharding.rules``, and the program pass that writes it into
every step's program (:mod:`.rewrite`)."""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
import numpy as np

import precision
from train.parallel.tensor.finder import Found, find
from train.parallel.tensor.plan import Kept, Split, TensorPlan, key_names
from train.parallel.tensor.rewrite import Rewrite, transformed

__all__ = ["TensorLayoutError", "find_layout", "plan_of", "parse_rules", "tensor_pass", "param_inputs", "param_shapes"]

#: The mesh axes a rule may give a param's dimension (``null``: whole).
RULE_AXES = ("tensor", "fsdp", None)


class TensorLayoutError(ValueError):
    """A model the ``tensor`` axis cannot split as asked (sizes it does not divide, a bad rule)."""


def param_inputs(paths: Sequence[Any], arrays: Sequence[Any], params: dict) -> list:
    """Each input's param path: the longest tail of its key path (an NNX variable's trailing
    ``value`` dropped) that is a path of ``params`` (``{path: shape}``) with the same shape;
    None for the other inputs (the batch, RNG keys, other collections)."""
    found = []
    for path, x in zip(paths, arrays):
        keys = key_names(path)
        if keys and keys[-1] in ("value", "raw_value"):
            keys = keys[:-1]
        tails = (keys[i:] for i in range(len(keys)))
        found.append(next((t for t in tails if params.get(t) == tuple(np.shape(x))), None))
    return found


def find_layout(trace: Callable[..., Any], args: tuple, params: Any, tensor: int) -> Found | None:
    """What :func:`~.finder.find` finds in the program of the model call ``trace(*args)`` makes
    (traced abstractly, under autocast's program pass), ``params`` its params (shapes will do);
    None where no call went through autocast (``precision.autocast=false``)."""
    found: list[Found] = []
    shapes = param_shapes(params)

    def record(fn, arrays, paths):
        if not found:
            closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(np.shape(x), _traced_dtype(x)) for x in arrays])
            found.append(find(closed.jaxpr, param_inputs(paths, arrays, shapes), tensor))
        return fn

    with precision.program_pass(record):
        jax.eval_shape(trace, *args)
    return found[0] if found else None


def param_shapes(params: Any) -> dict:
    """``{path: shape}`` of a params tree's leaves."""
    return {key_names(path): tuple(np.shape(x)) for path, x in jax.tree_util.tree_leaves_with_path(params)}


def _traced_dtype(x: Any) -> Any:
    dtype = np.dtype(x.dtype)
    return np.float32 if dtype in (np.dtype(np.float16), np.dtype(jax.numpy.bfloat16)) else dtype


def parse_rules(rules: Any) -> tuple:
    """``sharding.rules`` (``[[regex, [axis or null, ...]], ...]``) checked: ``((pattern, axes), ...)``."""
    parsed = []
    for i, rule in enumerate(rules or ()):
        if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)
                and isinstance(rule[1], (list, tuple))):
            raise TensorLayoutError(f"sharding.rules[{i}]: {rule!r} is not [regex, [axes...]] (e.g. "
                                    f"['.*/head/kernel', [null, tensor]])")
        try:
            re.compile(rule[0])
        except re.error as e:
            raise TensorLayoutError(f"sharding.rules[{i}]: {rule[0]!r} is not a regular expression ({e})") from None
        bad = [a for a in rule[1] if a not in RULE_AXES]
        if bad or len([a for a in rule[1] if a is not None]) != len({a for a in rule[1] if a is not None}):
            raise TensorLayoutError(f"sharding.rules[{i}]: axes {list(rule[1])}: each dimension takes tensor, fsdp "
                                    f"or null, each axis at most once")
        parsed.append((rule[0], tuple(rule[1])))
    return tuple(parsed)


def plan_of(found: Found | None, params: Any, tensor: int, fsdp: int, rules: tuple = ()) -> TensorPlan:
    """The plan of a model whose params are ``params`` (shapes will do): what ``found`` splits,
    then ``rules`` (the first matching each param's ``a/b/c`` path wins).

    Raises:
      TensorLayoutError: ``tensor`` does not divide a split's sizes (heads, features, the
        vocabulary), or a rule does not fit the param it names.
    """
    if found is not None and found.bad_sizes:
        raise TensorLayoutError(f"mesh.tensor={tensor} does not divide {found.bad_sizes[0]}"
                                + (f" (and {len(found.bad_sizes) - 1} more)" if len(found.bad_sizes) > 1 else "")
                                + "; choose a mesh.tensor that divides it, or keep the module whole with "
                                  "sharding.rules")
    shapes = param_shapes(params)
    splits, kept = [], []
    for path, shape in shapes.items():
        rule = _rule_for(path, rules)
        if rule is not None:
            splits.append(_ruled(path, shape, rule, tensor, fsdp))
        elif found is not None and path in found.splits:
            dim, role, module, parts = found.splits[path]
            splits.append(Split(path, dim, role, module, shape, parts=parts))
        elif found is not None:
            kept.append(Kept(path, found.kept.get(path, "not read by a matmul pair or a vocabulary lookup"), shape))
    return TensorPlan(tensor, tuple(splits), tuple(kept))


def _rule_for(path: tuple[str, ...], rules: tuple) -> tuple | None:
    name = "/".join(path)
    for pattern, axes in rules:
        if re.search(pattern, name):
            return pattern, axes
    return None


def _ruled(path: tuple, shape: tuple, rule: tuple, tensor: int, fsdp: int) -> Split:
    pattern, axes = rule
    name = "/".join(path)
    if len(axes) != len(shape):
        raise TensorLayoutError(f"sharding.rules: {pattern!r} gives {list(axes)} to {name} of shape {list(shape)}: "
                                f"one axis (or null) per dimension")
    for axis, n in zip(axes, shape):
        size = {"tensor": tensor, "fsdp": fsdp}.get(axis, 1)
        if n % size:
            raise TensorLayoutError(f"sharding.rules: {pattern!r} splits {name} {list(shape)} over {axis}={size}, "
                                    f"which does not divide {n}")
    dim = axes.index("tensor") if "tensor" in axes else None
    return Split(path, dim, "rule", "", shape, tuple(axes))


def tensor_pass(layout: Any) -> Callable:
    """The program pass (:func:`precision.program_pass`) writing ``layout``'s tensor-parallel
    plan into a model's program: the sites found in it again, those whose params the plan
    splits as found (a rule that keeps one whole drops its pair's sites)."""
    plan: TensorPlan = layout.tensor_plan

    shapes = {s.path: s.shape for s in plan.splits} | {k.path: k.shape for k in plan.kept}

    def transform(fn, arrays, paths):
        inputs = param_inputs(paths, arrays, shapes)

        def rewrite_of(closed):
            found = find(closed.jaxpr, inputs, layout.tensor)
            agree = {path for path, (dim, _, _, parts) in found.splits.items()
                     if (s := plan._by_path.get(path)) is not None and (s.dim, s.parts) == (dim, parts)}
            sites = {loc: site for loc, (site, params) in found.sites.items() if params <= agree}
            if not sites:
                return None
            sequence = layout.sequence_parallel and None not in found.sequences and all(
                n % layout.tensor == 0 for n in found.sequences)
            return Rewrite(sites, layout.mesh, layout.tensor, sequence, layout.tensor_reduce_dtype)

        return transformed(fn, rewrite_of)

    return transform
