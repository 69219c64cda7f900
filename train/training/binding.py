"""Any Flax model, Linen or NNX, bound to a policy as pure functions of arrays.

The train state, steps, checkpoints and layouts handle one model contract, the
Linen one: ``init(key, inputs) -> variables`` and ``apply(variables, inputs,
rngs=, mutable=, train=...)``, with variables ``{"params": ..., **state}`` as
nested dicts of arrays. :func:`bind` puts a model under its policy, through the
one door for that, :func:`precision.with_policy`: a Linen module under it has
the contract already; an NNX one gets it from :class:`NNXModel`, a functional
view, so NNX models get the same train state, steps, accumulation, sharding and
bit-exact checkpoints as Linen ones, through the same code. :func:`rebind`
(another policy, e.g. for half-precision inference) and :func:`cast_variables`
(float32 weights to the param dtypes) work on either.

Models signal training in different ways (``train=True``,
``deterministic=False``, ``training=True``, none at all, or NNX's
``model.train()`` / ``model.eval()`` modes): :func:`mode_kwargs` reads it from
the model's signature, so no model has to be edited to fit the framework; so does
:func:`inputs_as_for`, whether a dict of inputs is the call's keyword arguments or
its one input.
"""

from __future__ import annotations

import copy

import inspect
import types
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

import precision
from precision.quantized_weights import in_codes
from train.data.model_inputs import inputs_as

__all__ = ["NNXModel", "bind", "rebind", "cast_variables", "mode_kwargs", "call_mode_kwargs", "call_signature",
           "inputs_as_for", "doctor_subject", "TRAIN_KEYWORDS"]

#: Call keywords by which models learn that they are training, and their value when training.
TRAIN_KEYWORDS = {"train": True, "training": True, "is_training": True, "deterministic": False}


def call_mode_kwargs(fn: Any, train: bool) -> dict[str, bool]:
    """The keyword ``fn``'s signature takes to tell training from evaluation, set
    for ``train`` (``{}`` if it takes none of :data:`TRAIN_KEYWORDS`)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    for name, when_training in TRAIN_KEYWORDS.items():
        param = parameters.get(name)
        if param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            return {name: when_training if train else not when_training}
    return {}


def mode_kwargs(model: Any, train: bool) -> dict[str, bool]:
    """Keyword arguments telling a wrapped model (``model.apply``) whether it trains."""
    if isinstance(model, NNXModel):
        return {"train": train}
    module = getattr(model, "module", model)
    return call_mode_kwargs(type(module).__call__, train)


def doctor_subject(model: Any, variables: dict, train: bool) -> tuple[Any, Any, dict]:
    """What :func:`precision.diagnose` takes for a bound model holding ``variables``: ``(target,
    variables, mode kwargs)``; an NNX module is given merged with them (the doctor takes NNX
    modules as they are, not the Linen contract :class:`NNXModel` adds)."""
    if isinstance(model, NNXModel):
        return model.merge(variables, train=train), None, call_mode_kwargs(model.module_type.__call__, train)
    return model, variables, mode_kwargs(model, train)


def call_signature(model: Any) -> inspect.Signature | None:
    """The signature of ``model``'s call as the framework makes it, ``self`` left out (None where
    it cannot be read): a Linen or NNX module, wrapped by :func:`precision.with_policy` or
    :func:`bind` or not; its ``__call__`` a method, a decorated one, a ``functools.partialmethod``."""
    cls = _module_class(model)
    call = inspect.getattr_static(cls, "__call__", None)
    try:
        if hasattr(call, "__get__") and not isinstance(call, (staticmethod, classmethod)):  # a method: bound to self
            return inspect.signature(types.MethodType(cls.__call__, object()))
        return inspect.signature(cls.__call__)
    except (TypeError, ValueError):
        return None


def inputs_as_for(model: Any, inputs: Any, choice: str = "auto") -> str:
    """``"kwargs"`` or ``"dict"``: how ``model`` takes ``inputs`` (a dict of arrays, or
    anything else), decided from its signature unless ``choice`` says
    (:func:`train.data.model_inputs.inputs_as`)."""
    return inputs_as(call_signature(model) if choice == "auto" else None, inputs, choice,
                     _module_class(model).__name__)


def _module_class(model: Any) -> type:
    """The class of the module ``model`` is or wraps."""
    if isinstance(model, NNXModel):
        return model.module_type
    if isinstance(model, (precision.LinenWithPolicy, precision.NNXWithPolicy)):
        return type(model.module)
    return type(model)


def bind(model: Any, policy: "str | precision.Policy | None", rules: Any = None, *,
         ops: precision.OpLists | None = None, autocast: bool = True, fp8: Any = None,
         reduce_dtype: Any = None, int8: Any = None) -> Any:
    """``model`` under ``policy`` with the Linen ``init`` / ``apply`` contract.

    Takes a Linen or NNX module, or one already wrapped by
    :func:`precision.with_policy` (then ``policy`` must match or be ``None``
    and ``rules``, ``ops``, ``autocast`` be left at their defaults).
    ``reduce_dtype`` (see :func:`precision.with_policy`), when given, replaces
    a wrapped model's own.
    """
    if isinstance(model, (precision.LinenWithPolicy, precision.NNXWithPolicy, NNXModel)):
        if policy is not None and precision.get_policy(policy) != model.policy:
            raise ValueError(f"policy {policy!r} differs from the wrapped model's {model.policy}; pass "
                             f"policy=None or an unwrapped module")
        if ops is not None or not autocast or rules is not None:
            raise ValueError("`rules`, `ops` and `autocast` apply to an unwrapped module; the wrapped model has "
                             "its own (precision.with_policy(module, policy, rules, ops=..., autocast=...))")
        if fp8 is not None and precision.fp8.as_fp8_options(fp8) != model.fp8:
            raise ValueError(f"fp8={fp8!r} differs from the wrapped model's {model.fp8}; pass fp8=None or give it "
                             "to precision.with_policy")
        if int8 is not None and precision.int8.as_int8_options(int8) != model.int8:
            raise ValueError(f"int8={int8!r} differs from the wrapped model's {model.int8}; pass int8=None or give "
                             "it to precision.with_policy")
        if reduce_dtype is not None:
            model = _reducing_in(model, reduce_dtype)
        return NNXModel(model) if isinstance(model, precision.NNXWithPolicy) else model
    if isinstance(model, nn.Module):
        return precision.with_policy(model, policy, rules, ops=ops, autocast=autocast, fp8=fp8,
                                     reduce_dtype=reduce_dtype, int8=int8)
    if isinstance(model, nnx.Module):
        # A copy: the caller's module keeps its params and their dtypes.
        return NNXModel(precision.with_policy(nnx.clone(model), policy, rules, ops=ops, autocast=autocast, fp8=fp8,
                                              reduce_dtype=reduce_dtype, int8=int8))
    raise TypeError(f"expected a flax.linen.Module or flax.nnx.Module (or one wrapped by precision.with_policy), "
                    f"got {type(model).__name__}")


def _reducing_in(model: Any, reduce_dtype: Any) -> Any:
    """A copy of a wrapped model whose params' gradients are produced in ``reduce_dtype``."""
    dtype = precision.reduce_dtype_of(reduce_dtype)
    if dtype == model.reduce_dtype:
        return model
    precision.modules.common.check_needs_autocast(model.policy, model.rules, model.autocast, dtype)
    if isinstance(model, NNXModel):  # the unwrapped module, bound afresh
        return bind(model.module, model.policy, model.rules, ops=model.ops, autocast=model.autocast, fp8=model.fp8,
                    reduce_dtype=dtype, int8=model.int8)
    other = nnx.clone(model) if isinstance(model, precision.NNXWithPolicy) else copy.copy(model)
    other.reduce_dtype = dtype
    return other


class _Layout:
    """How an NNX state maps to a nested dict of arrays with string keys, and back."""

    def __init__(self, state: nnx.State):
        self.treedef = jax.tree_util.tree_structure(state)
        self.paths = [tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))[1:]
                      for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]

    def to_tree(self, state: nnx.State) -> dict:
        tree: dict = {}
        for path, leaf in zip(self.paths, jax.tree_util.tree_leaves(state), strict=True):
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = leaf
        return tree

    def from_tree(self, tree: dict) -> nnx.State:
        leaves = []
        for path in self.paths:
            node = tree
            for key in path:
                node = node[key]
            leaves.append(node)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


class NNXModel:
    """An NNX module under a policy with Linen's ``init`` / ``apply``.

    Variables are ``{"params": ...}`` plus ``{"state": ...}`` when the module
    has other state (BatchNorm statistics), nested dicts keyed by attribute
    names, with params in their param dtypes. ``apply(..., train=True)`` runs
    the module in training mode (``model.train()``: dropout on, batch
    statistics) and reseeds its RNG streams from ``rngs``, so dropout is a pure
    function of the key the train step derives from ``(state.rng, step)``;
    ``train=False`` runs it in eval mode. The module's own ``train`` /
    ``deterministic`` keyword, if its call takes one, is set to match.
    """

    def __init__(self, wrapped: precision.NNXWithPolicy):
        self.policy = wrapped.policy
        self.rules = wrapped.rules
        self.autocast = wrapped.autocast
        self.ops = wrapped.ops
        self.fp8 = wrapped.fp8
        self.reduce_dtype = wrapped.reduce_dtype
        self.module_type = type(wrapped.module)
        wrapped.eval()
        self._eval_graph, params, rngs, rest = nnx.split(wrapped, nnx.Param, nnx.RngState, ...)
        wrapped.train()
        self._train_graph = nnx.split(wrapped, nnx.Param, nnx.RngState, ...)[0]
        self._params, self._rest = _Layout(params), _Layout(rest)
        self._rngs = rngs
        self._streams = sorted({v.tag for v in jax.tree_util.tree_leaves(
            rngs, is_leaf=lambda x: isinstance(x, nnx.Variable)) if isinstance(v, nnx.RngKey)})
        initial = {"params": self._params.to_tree(params)}
        if self._rest.paths:
            initial["state"] = self._rest.to_tree(rest)
        self._initial = jax.device_get(initial)  # on the host: no second copy of the model on the device

    def __repr__(self) -> str:
        return f"NNXModel({self.module_type.__name__}, {str(self.policy)!r})"

    @property
    def module(self) -> nnx.Module:
        """The unwrapped module (with its initial values), e.g. for its signature."""
        return self.merge(self._initial, train=False).module

    def merge(self, variables: Any, *, train: bool = False) -> precision.NNXWithPolicy:
        """The module under its policy holding ``variables``, in train or eval mode."""
        state = variables.get("state", self._initial.get("state"))
        rest = self._rest.from_tree(state) if self._rest.paths else nnx.State({})
        graph = self._train_graph if train else self._eval_graph
        rngs = jax.tree_util.tree_map(lambda x: x, self._rngs)  # fresh variables: reseeding must not touch ours
        params = precision.dequantized(variables["params"])  # 8/4-bit weights (a frozen base) read as floats
        return nnx.merge(graph, self._params.from_tree(params), rngs, rest)

    def init(self, rngs: Any = None, *args: Any, **kwargs: Any) -> dict:
        """The module's variables, params in their param dtypes. An NNX module is
        initialised when constructed, so ``rngs`` and the inputs are not used,
        except to find the FP8 matmuls whose amax histories delayed scaling keeps
        (the ``"fp8"`` collection)."""
        del rngs, kwargs
        variables = dict(self._initial)
        if args and self.fp8.delayed and precision.modules.common.uses_fp8(self.policy, self.rules):
            wrapped = self.merge(variables, train=True)
            variables[precision.FP8_COLLECTION] = wrapped.init_fp8_state(
                *args, **call_mode_kwargs(self.module_type.__call__, True))
        return variables

    def apply(self, variables: Any, *args: Any, rngs: Any = None, mutable: Any = False, train: bool = False,
              **kwargs: Any) -> Any:
        """Calls the module on ``args`` with ``variables``; with ``mutable``, also
        returns the updated ``{"state": ...}``."""
        fp8_state = variables.get(precision.FP8_COLLECTION)
        wrapped = self.merge(variables, train=train)
        if rngs is not None and self._streams:
            key = rngs.get("dropout", next(iter(rngs.values()))) if isinstance(rngs, dict) else rngs
            # A stream of stacked layers (nnx.split_rngs + nnx.vmap) holds one key per layer: each gets its own.
            nnx.reseed(wrapped, policy="match_shape",
                       **{name: jax.random.fold_in(key, i) for i, name in enumerate(self._streams)})
        out = wrapped.call_with_fp8_state(fp8_state, *args, **call_mode_kwargs(self.module_type.__call__, train),
                                          **kwargs)
        if not mutable:
            return out
        # The state it had before the call: not the values a call sows (nnx.Intermediate).
        kept = nnx.Not(nnx.Any(nnx.Param, nnx.RngState, nnx.Intermediate))
        new = {"state": self._rest.to_tree(nnx.state(wrapped, kept))} if self._rest.paths else {}
        if fp8_state is not None:  # unchanged: its new value is its gradient (precision.fp8)
            new[precision.FP8_COLLECTION] = fp8_state
        return out, new


def rebind(model: Any, policy: "str | precision.Policy", rules: Any = None) -> Any:
    """A bound model (:func:`bind`) under another policy: the same module, its
    rules (unless ``rules`` are given), op lists and autocast setting kept."""
    rules = model.rules if rules is None else rules
    if isinstance(model, NNXModel):  # the unwrapped module, bound afresh
        return bind(model.module, policy, rules, ops=model.ops, autocast=model.autocast, fp8=model.fp8,
                    reduce_dtype=model.reduce_dtype)
    return model.with_policy(policy, rules)  # a Linen wrapper keeps the module structure it recorded


def cast_variables(model: Any, variables: Any, *sample_args: Any, **sample_kwargs: Any) -> dict:
    """``variables`` (float32 weights, e.g. trained ones) with their params cast
    to the bound model's param dtypes, where they are (sharded arrays stay
    sharded). Sample inputs, traced abstractly, are needed only by a Linen model
    that has not run yet and whose rules match class names."""
    if isinstance(model, NNXModel):
        stored = model.init()["params"]
        params = jax.tree_util.tree_map(  # a frozen base in codes stays in them, read back in the param dtype
            lambda v, ref: v.replace(dtype=np.dtype(ref.dtype)) if in_codes(v) else v.astype(ref.dtype),
            variables["params"], stored, is_leaf=in_codes)
        return {**variables, "params": params}
    return model.cast_params(variables, *sample_args, **sample_kwargs)
