"""Where a train state's first variables come from: the model's fresh init (created in
their sharding), variables given (checked and cast to the policy), or pretrained weights
(:mod:`train.weights.pretrained`, the fresh init where they have none)."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

import precision
from train.data.model_inputs import call_arguments, call_with
from train.parallel.distributed import Layout
from train.parallel.tensor.planning import TensorLayoutError, find_layout, plan_of
from train.training.binding import cast_variables, mode_kwargs
from train.training.tree_paths import leaf_shapes
from train.weights.pretrained import pretrained_variables

__all__ = ["initial_variables", "planned_layout", "sharded_jit"]


def initial_variables(wrapped: Any, keys: dict, sample_input: Any, variables: Any,
                      init_from: str | os.PathLike | None, layout: Layout | None, inputs_as: str = "kwargs") -> dict:
    """The variables a state of the bound model ``wrapped`` starts from: ``init_from``'s
    weights, else ``variables`` (checked, cast to the policy), else its init with ``keys``;
    a dict of inputs passed as ``inputs_as`` says (:mod:`train.data.model_inputs`)."""
    mode = mode_kwargs(wrapped, False)
    init = _init(wrapped, mode, inputs_as)
    if init_from is not None:
        variables = _pretrained(init, keys, sample_input, init_from, variables)
    if variables is None:
        return sharded_jit(init, layout)(keys, sample_input)
    return _given_variables(wrapped, init, keys, sample_input, mode, variables, inputs_as)


def planned_layout(wrapped: Any, keys: dict, sample_input: Any, layout: Layout | None,
                   inputs_as: str = "kwargs") -> Layout | None:
    """``layout`` with the plan of how its ``tensor`` axis (and ``sharding.rules``) split the
    bound model's params, found in the program of its call on ``sample_input``
    (:mod:`train.parallel.tensor`); the layout as it is when it needs none.

    Raises:
      TensorLayoutError: ``tensor`` does not divide the heads, features or vocabulary it
        splits, a rule does not fit its param, or the model is not run under autocast."""
    if layout is None or not layout.needs_plan:
        return layout
    mode = mode_kwargs(wrapped, False)
    shapes = jax.eval_shape(_init(wrapped, mode, inputs_as), keys, sample_input)
    args, kwargs = call_arguments(sample_input, inputs_as)
    found = None
    if layout.tensor > 1:
        found = find_layout(lambda v: wrapped.apply(v, *args, **kwargs, **mode), (shapes,), shapes["params"],
                            layout.tensor)
        if found is None:
            raise TensorLayoutError(f"mesh.tensor={layout.tensor}: tensor parallelism is written into the model's "
                                    f"program by autocast; this model runs without it (precision.autocast=false)")
    return layout.with_plan(plan_of(found, shapes["params"], layout.tensor, layout.fsdp, layout.rules))


def _given_variables(wrapped: Any, init: Any, keys: dict, sample_input: Any, mode: dict, variables: Any,
                     inputs_as: str) -> dict:
    """``variables`` checked against the model's and cast to its policy (fp8 histories started empty)."""
    expected = jax.eval_shape(init, keys, sample_input)
    if precision.FP8_COLLECTION in expected and precision.FP8_COLLECTION not in variables:  # start them empty
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), expected[precision.FP8_COLLECTION])
        variables = {**variables, precision.FP8_COLLECTION: zeros}
    _check_variables(variables, expected)
    given = {id(x) for x in jax.tree_util.tree_leaves(variables)}
    args, kwargs = call_arguments(sample_input, inputs_as)
    cast = cast_variables(wrapped, dict(variables), *args, **kwargs, **mode)
    # the state owns its buffers: the train step donates them, and the caller's (two policies
    # compared from one init) must outlive it
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True) if id(x) in given else x, cast)


def _init(wrapped: Any, mode: dict, inputs_as: str) -> Any:
    """``init(keys, inputs)`` of the bound model, the inputs one array or several
    (:mod:`train.data.model_inputs`)."""
    return lambda keys, inputs: call_with(wrapped.init, inputs, keys, inputs_as=inputs_as, **mode)


def _pretrained(init: Any, keys: dict, sample_input: Any, init_from: Any, variables: Any) -> dict:
    """The variables ``init_from`` holds for the model whose ``init`` is given, with its fresh
    init where it has none."""
    if variables is not None:
        raise ValueError("create_train_state: give `variables` or `init_from`, not both")
    init = jax.jit(init)
    return pretrained_variables(init_from, jax.eval_shape(init, keys, sample_input), lambda: init(keys, sample_input))


def _check_variables(given: Any, expected: Any) -> None:
    """Given variables must have the paths and shapes the model creates."""
    want, got = leaf_shapes(dict(expected)), leaf_shapes(dict(given))
    for path in sorted(set(want) | set(got)):
        if want.get(path) != got.get(path):
            raise ValueError(f"create_train_state: `variables` do not match the model at {path}: the model has "
                             f"{want.get(path, 'nothing')}, the variables have {got.get(path, 'nothing')}")


def sharded_jit(fn: Any, layout: Layout | None) -> Any:
    """``jax.jit(fn)``, with outputs born in their layout's sharding."""
    if layout is None:
        return jax.jit(fn)

    def call(*args):
        shardings = layout.state(jax.eval_shape(fn, *args))
        return jax.jit(fn, out_shardings=shardings)(*args)

    return call
