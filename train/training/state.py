"""The train state: everything that changes while training, as one pytree."""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

import precision
from precision.loss_scale import LossScale
from train.parallel.distributed import Layout
from train.training.binding import NNXModel, bind, call_mode_kwargs, inputs_as_for, mode_kwargs
from train.training.initial import initial_variables, planned_layout, sharded_jit
from train.data.model_inputs import call_arguments, describe_inputs
from train.references import one_line
from train.training.tree_paths import leaf_shapes
from train.finetune import FineTune, base_dtype, finetune_frozen, finetune_model, merge, param_paths, stored_frozen, \
    trainable


class TrainState(struct.PyTreeNode):
    """Step, params (float32 masters unless the policy stores half params, whose
    float32 masters then live in the optimizer state), optimizer state (holding
    the loss-scale state), model state (BatchNorm statistics) and the RNG key.

    ``model`` (the module under its policy), ``tx`` (the mixed-precision
    optimizer) and ``layout`` (the mesh and shardings it was created in, if any)
    are static: they are not saved in checkpoints and define how the arrays are
    used. A step made without a layout runs a state in its own.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    model: Any = struct.field(pytree_node=False)  # precision.LinenWithPolicy or train.NNXModel
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    layout: Layout | None = struct.field(pytree_node=False, default=None)  # the mesh it was created on
    #: Paths of the params that are not trained (:mod:`train.finetune`): no gradient, master or optimizer state.
    frozen: frozenset = struct.field(pytree_node=False, default=frozenset())
    #: How the model takes a dict of inputs: ``"kwargs"`` (``model(**inputs)``) or ``"dict"`` (``model(inputs)``).
    inputs_as: str = struct.field(pytree_node=False, default="kwargs")

    @property
    def policy(self) -> precision.Policy:
        """The model's precision policy."""
        return self.model.policy

    @property
    def trained_params(self) -> Any:
        """``params`` with ``None`` in place of each frozen one: what gradients, masters and
        the optimizer state cover (all of ``params`` when nothing is frozen)."""
        return trainable(self.params, self.frozen)

    @property
    def loss_scale(self) -> LossScale:
        """The loss scale the next step multiplies the loss by."""
        return precision.current_loss_scale(self.opt_state)

    # Flax's ``flax.training.train_state.TrainState`` habits (docs/flax-habits.md).

    @property
    def apply_fn(self) -> Callable[..., Any]:
        """The model's ``apply`` under its policy, as Flax's ``state.apply_fn``:
        ``state.apply_fn({"params": state.params, **state.model_state}, x, train=True)``."""
        return self.model.apply

    @classmethod
    def create(cls, **kwargs: Any) -> "TrainState":
        """Not Flax's constructor: a mixed-precision state needs the module, not only its ``apply``."""
        raise TypeError("TrainState.create: a mixed-precision state needs the module (to run it under its "
                        "policy), not only its apply_fn: use train.create_train_state(module, policy, tx, rng, "
                        "sample_input, variables={'params': params}) (docs/flax-habits.md)")

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        """``loss`` times this state's loss scale: what to differentiate for :meth:`apply_gradients`."""
        return self.loss_scale.scale(loss)

    def value_and_grad(self, fn: Callable[..., Any], has_aux: bool = False) -> Callable[..., tuple[Any, "ScaledGrads"]]:
        """``jax.value_and_grad(fn, has_aux)`` (with respect to the first argument) of the
        *scaled* loss: returns ``fn``'s own (unscaled) value and :class:`ScaledGrads`,
        which :meth:`apply_gradients` takes under any loss scale."""
        def scaled(*args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
            out = fn(*args, **kwargs)
            return self.scale_loss(out[0] if has_aux else out), out

        grad_fn = jax.grad(scaled, has_aux=True)

        def value_and_grads(*args: Any, **kwargs: Any) -> tuple[Any, ScaledGrads]:
            grads, out = grad_fn(*args, **kwargs)
            return out, ScaledGrads(grads, out[0] if has_aux else out)

        return value_and_grads

    def grad(self, fn: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
        """``jax.grad(fn, has_aux)`` of the scaled loss: :class:`ScaledGrads` (and ``fn``'s aux)."""
        value_and_grads = self.value_and_grad(fn, has_aux)

        def grads(*args: Any, **kwargs: Any) -> Any:
            out, scaled = value_and_grads(*args, **kwargs)
            return (scaled, out[1]) if has_aux else scaled

        return grads

    def apply_gradients(self, *, grads: "ScaledGrads | Any", **kwargs: Any) -> "TrainState":
        """One optimizer step, as Flax's ``apply_gradients``, through the mixed-precision
        optimizer: unscale, finiteness check (of the loss too, when ``grads`` carry it),
        skip or update (float32 masters of half params), adjust the loss scale. ``step``
        counts every call, skipped or not, as :func:`train.make_train_step` does;
        ``kwargs`` replace fields (``model_state=``). ``grads`` are :class:`ScaledGrads`,
        or under no loss scale (bfloat16, float32) a plain tree like ``state.params``;
        with frozen params, like :attr:`trained_params` (``None`` where frozen)."""
        scaled = _scaled_grads(grads, self.loss_scale)
        trained, grads = self.trained_params, scaled.grads
        _check_no_frozen_grads(grads, self.frozen)
        _check_grads_match(grads, trained)
        extra = {} if scaled.loss is None else {"value": scaled.loss}  # a non-finite loss skips the step too
        if scaled.sharded:
            extra["grads_sharded"] = True
        updates, opt_state = self.tx.update(grads, self.opt_state, trained, **extra)
        return self.replace(step=self.step + 1, params=merge(optax.apply_updates(trained, updates), self.params),
                            opt_state=opt_state, **kwargs)


class ScaledGrads(struct.PyTreeNode):
    """Gradients of the scaled loss (``state.scale_loss(loss)``), marked as such, and
    the unscaled ``loss`` they came from (or None). :meth:`TrainState.apply_gradients`
    refuses unmarked gradients under a loss scale: gradients of the unscaled loss would
    silently move params ``loss_scale`` (32768) times too little, after underflowing
    in float16. :meth:`TrainState.value_and_grad` makes them; wrap your own gradients
    of ``state.scale_loss(loss)`` in it."""

    grads: Any
    loss: Any = None
    #: The gradients are split over devices (FSDP): the optimizer checks them leaf by leaf.
    sharded: bool = struct.field(pytree_node=False, default=False)


def _scaled_grads(grads: Any, loss_scale: LossScale) -> ScaledGrads:
    """``grads`` as :class:`ScaledGrads`; a plain tree only where the scale is 1 (no loss scale)."""
    if isinstance(grads, ScaledGrads):
        return grads
    if not isinstance(loss_scale, precision.NoOpLossScale):
        raise ValueError(
            f"TrainState.apply_gradients: this state scales the loss ({type(loss_scale).__name__}) and `grads` "
            f"are not marked as gradients of the scaled loss: gradients of the unscaled loss would move params "
            f"loss_scale (e.g. 32768) times too little; take them with state.value_and_grad(loss_fn) or "
            f"state.grad(loss_fn), or differentiate state.scale_loss(loss) and pass grads=train.ScaledGrads(grads)")
    return ScaledGrads(grads)


def _check_no_frozen_grads(grads: Any, frozen: frozenset) -> None:
    """A frozen param receives no update: gradients given for one are an error (checked while tracing)."""
    given = [path for path in param_paths(grads) if path in frozen] if frozen else []
    if given:
        raise ValueError(f"TrainState.apply_gradients: `grads` hold gradients of {len(given)} frozen params (e.g. "
                         f"{given[0]}), which are not trained: differentiate with respect to state.trained_params "
                         f"(None where a param is frozen) and pass the frozen ones in through train.finetune.merge")


def _check_grads_match(grads: Any, params: Any) -> None:
    """Gradients must have the params' paths and shapes (checked while tracing: no cost)."""
    want, got = leaf_shapes(params), leaf_shapes(grads)
    for path in sorted(set(want) | set(got)):
        if want.get(path) != got.get(path):
            raise ValueError(f"TrainState.apply_gradients: `grads` do not match state.params at {path or '<root>'}: "
                             f"the params have {want.get(path, 'nothing')}, the grads {got.get(path, 'nothing')} "
                             f"(differentiate with respect to state.params)")


def create_train_state(model: Any, policy: "str | precision.Policy | None", optimizer: optax.GradientTransformation,
                       rng: jax.Array, sample_input: Any, *, rules: Any = None,
                       loss_scale: "str | LossScale" = "auto", max_grad_norm: float | None = None,
                       skip_with: str = "auto", layout: Layout | None = None, variables: Any = None,
                       ops: precision.OpLists | None = None, autocast: bool = True, strict: bool = False,
                       fp8: "precision.Fp8Options | dict | None" = None, reduce_dtype: Any = "auto",
                       init_from: str | os.PathLike | None = None, memory: int | None = None,
                       finetune: FineTune | None = None, inputs_as: str = "auto",
                       int8: "precision.Int8Options | dict | None" = None) -> TrainState:
    """Initialises a model under ``policy`` and a mixed-precision optimizer around ``optimizer``.

    Args:
      model: an unmodified Flax Linen or NNX module, or one already wrapped by
        :func:`precision.with_policy` (then ``policy`` must match it or be
        ``None``). Its call may take ``train`` / ``training`` /
        ``deterministic`` or no such keyword (see :func:`train.mode_kwargs`).
        An NNX module arrives initialised: its params (cast to the policy's
        param dtypes; the module passed in is left as it was) and other state
        (BatchNorm statistics) start the train state, and its dropout is
        reseeded every step from the state's key.
      policy: a policy spec, preset name or :class:`precision.Policy`.
      optimizer: the inner optax optimizer; it is wrapped by
        :func:`precision.mixed_precision` unless it already is.
      rng: a PRNG key; split into init keys and the state's key (dropout).
      sample_input: a batch of inputs (any batch size) to initialise shapes.
      rules: per-module precision rules (see :mod:`precision.rules`).
      loss_scale: ``"auto"``, ``"none"``, ``"static"``, ``"dynamic"`` or a loss
        scale object such as ``precision.DynamicLossScale(2.0 ** 15)``.
      max_grad_norm, skip_with: passed to :func:`precision.mixed_precision`.
      layout: when given, params and optimizer state are created directly in
        their sharding on its mesh (never whole on one device), the rest
        replicated.
      variables: start from these (float32) variables, ``{"params": ...,
        "batch_stats": ...}``, instead of initialising: to fine-tune trained
        weights under another policy, or to compare policies from one init.
        Their params are cast to the policy's param dtypes.
      ops, autocast: passed to :func:`precision.with_policy` (allow/deny op
        lists; ``autocast=False`` only casts at module boundaries).
      strict: raise :class:`precision.CoverageError`, instead of warning, when a
        half-compute policy leaves more than 5% of the model's matmul/conv FLOPs
        in float32 for a reason other than a rule (see :func:`precision.explain`).
      fp8, int8: :func:`precision.fp8_options` (:func:`precision.int8_options`) for a policy whose compute
        is ``f8`` (``int8``). Under delayed FP8 scaling the amax histories are model state (the ``"fp8"``
        collection): checkpointed, replicated, updated by the train step; int8 keeps none.
      reduce_dtype: the dtype the gradients of params read in half precision
        are produced in, so the dtype a data-parallel step reduces them across
        devices in: ``"f32"``, ``"bf16"`` or ``"f16"`` (which needs a loss
        scale). ``"auto"``: float32 when ``layout``'s mesh has more than one
        device (the batch split, or layers split over ``tensor``), otherwise the
        compute dtype (one device reduces nothing). See :func:`precision.with_policy`.
      init_from: start from pretrained weights, cast as ``variables`` are: another run's workdir
        or checkpoint, or a Hugging Face Flax directory (:mod:`train.weights.pretrained`).
      memory: bytes the state and one step's gradients must fit in, checked from their shapes
        and dtypes before the optimizer state is allocated (:class:`StateTooLarge`).
      finetune: :class:`train.FineTune`: LoRA adapters added to ``model`` (qwix) and params
        frozen (no gradient, master or optimizer state; stored in ``finetune.base``); see
        ``docs/fine-tuning.md``. :class:`train.finetune.FreezeError` for a setting that does
        not apply to the model.
      inputs_as: a dict of inputs passed as ``"kwargs"`` (``model(**inputs)``), ``"dict"``
        (``model(inputs)``) or ``"auto"``: as its ``__call__`` takes them; ``state.inputs_as``.
    """
    inputs_as = inputs_as_for(model, sample_input, inputs_as)
    model = finetune_model(model, finetune, sample_input, inputs_as)
    wrapped = _bound(model, policy, rules, ops=ops, autocast=autocast, fp8=fp8, int8=int8,
                     reduce_dtype=_reduce_dtype(reduce_dtype, layout, model, autocast))
    _check_coverage(wrapped, sample_input, strict, inputs_as)
    rng, keys = _init_keys(rng)
    layout = planned_layout(wrapped, keys, sample_input, layout, inputs_as)
    variables = initial_variables(wrapped, keys, sample_input, variables, init_from, layout, inputs_as)
    frozen = finetune_frozen(variables["params"], finetune)
    params = stored_frozen(variables["params"], frozen, base_dtype(finetune))
    trained = trainable(params, frozen)
    model_state = {k: v for k, v in variables.items() if k != "params"}
    tx = _mixed_precision_optimizer(optimizer, trained, wrapped.policy, loss_scale, max_grad_norm, skip_with)
    _check_state(wrapped, params, trained, jax.eval_shape(tx.init, trained), memory)
    state = TrainState(step=jnp.zeros([], jnp.int32), params=params, opt_state=sharded_jit(tx.init, layout)(trained),
                       model_state=model_state, rng=rng, model=wrapped, tx=tx, layout=layout, frozen=frozen,
                       inputs_as=inputs_as)
    return state if layout is None else layout.put_state(state)


def _bound(model: Any, policy: Any, rules: Any, **options: Any) -> Any:
    """:func:`bind`, its errors (a bad policy, rule or option) named as ``create_train_state``'s."""
    try:
        return bind(model, policy, rules, **options)
    except (TypeError, ValueError) as e:
        raise type(e)(f"create_train_state: {e}") from None


def _init_keys(rng: jax.Array) -> tuple[jax.Array, dict]:
    """The state's key (raw ``uint32`` data, as checkpoints store it) and the init's keys, from ``rng``."""
    if jax.dtypes.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    rng, params_key, dropout_key = jax.random.split(rng, 3)
    return rng, {"params": params_key, "dropout": dropout_key}


def _reduce_dtype(reduce_dtype: Any, layout: Layout | None, model: Any, autocast: bool) -> Any:
    """``reduce_dtype`` with ``"auto"`` resolved: float32 where gradients are reduced across
    devices (under autocast, which makes it), unless a wrapped model has its own."""
    if isinstance(reduce_dtype, str) and reduce_dtype.strip().lower() == "auto":
        if isinstance(model, (precision.LinenWithPolicy, precision.NNXWithPolicy, NNXModel)):
            if model.reduce_dtype is not None:
                return None  # bind keeps the wrapper's own
            autocast = model.autocast
        # any mesh of more than one device (a tensor-parallel one sums some gradients across tensor)
        return "f32" if autocast and layout is not None and layout.mesh.devices.size > 1 else None
    if reduce_dtype is None:
        raise precision.PolicyError("reduce_dtype=None: give 'auto', 'f32', 'bf16' or 'f16'")
    return precision.reduce_dtype_of(reduce_dtype)


def _check_reduce_dtype(wrapped: Any, scale: LossScale) -> None:
    """A float16 reduction needs a loss scale (the optimizer's, whoever made it)."""
    if wrapped.reduce_dtype == jnp.float16 and isinstance(scale, precision.NoOpLossScale):
        raise precision.PolicyError(
            "create_train_state: reduce_dtype=f16 needs a loss scale (gradients reduced in float16 underflow and "
            f"overflow without one), and this run has none (policy {wrapped.policy}): give loss_scale='dynamic', "
            "or reduce_dtype='bf16' or 'f32'")


def _check_coverage(wrapped: Any, sample_input: Any, strict: bool, inputs_as: str) -> None:
    """Warns (raises if ``strict``) when the policy leaves the model's matmuls in float32."""
    if wrapped.policy.compute_dtype == jnp.float32:
        return
    try:
        explanation = explain_model(wrapped, sample_input, train=False, backward=False, inputs_as=inputs_as)
    except (precision.PolicyError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - the user's model raised: say so in one line, not its traceback
        raise ValueError(f"create_train_state: checking which of {_model_name(wrapped)}'s ops the policy reaches "
                         f"(the model traced on a sample batch, inputs {describe_inputs(sample_input)}) failed: "
                         f"{one_line(e)}") from None
    precision.check_coverage(explanation, strict=strict, stacklevel=4)


def _model_name(wrapped: Any) -> str:
    module = wrapped.module_type if isinstance(wrapped, NNXModel) else getattr(wrapped, "module", wrapped)
    return module.__name__ if isinstance(module, type) else type(module).__name__


class StateTooLarge(ValueError):
    """The train state would not fit in the memory :func:`create_train_state` was given."""

    def __init__(self, need: int, memory: int, per_param: dict[str, float]):
        self.need, self.memory, self.per_param = need, memory, per_param
        super().__init__(f"create_train_state: the train state needs {need:,} bytes ({self.parts()}), more than "
                         f"the {memory:,} bytes of memory given")

    def parts(self) -> str:
        """``16 bytes/param: params 4, optimizer 8, gradients 4``."""
        parts = ", ".join(f"{k} {v:.2g}" for k, v in self.per_param.items() if k != "total" and v >= 0.01)
        return f"{self.per_param['total']:.3g} bytes/param: {parts}"


def _check_state(wrapped: Any, params: Any, trained: Any, opt_state: Any, memory: int | None) -> None:
    """The reduce dtype fits the loss scale; the state and one step's gradients (of the
    ``trained`` params) fit in ``memory`` (else :class:`StateTooLarge`)."""
    _check_reduce_dtype(wrapped, precision.current_loss_scale(opt_state))
    if not memory:
        return
    per_param = precision.state_bytes(params, opt_state)
    count = sum(x.size for x in jax.tree_util.tree_leaves(params)) or 1
    gradients = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(trained)) / count  # params' dtypes
    per_param = {**{k: v for k, v in per_param.items() if k != "total"}, "gradients": gradients,
                 "total": per_param["total"] + gradients}
    need = int(per_param["total"] * count)
    if need > memory:
        raise StateTooLarge(need, memory, per_param)


def _mixed_precision_optimizer(optimizer, params, policy, loss_scale, max_grad_norm, skip_with):
    try:
        precision.find_mixed_precision_state(jax.eval_shape(optimizer.init, params))
        return optimizer  # already wrapped
    except ValueError:
        pass
    scale = precision.get_loss_scale(loss_scale, policy) if isinstance(loss_scale, str) else loss_scale
    return precision.mixed_precision(optimizer, scale, max_grad_norm=max_grad_norm, skip_with=skip_with,
                                     master_dtype=policy.master_dtype,
                                     master_rounding=policy.master_rounding or "stochastic",
                                     state_dtype=policy.state_dtype)


def explain_model(wrapped: Any, sample_input: Any, *, train: bool, backward: bool,
                  inputs_as: str = "auto") -> precision.Explanation:
    """:func:`precision.explain` of a bound model (Linen or NNX) in train or eval mode, a dict of
    inputs passed as ``inputs_as`` says (a state's ``inputs_as``; ``"auto"``: :func:`inputs_as_for`)."""
    args, kwargs = call_arguments(sample_input, inputs_as_for(wrapped, sample_input, inputs_as))
    if isinstance(wrapped, NNXModel):
        return precision.explain(wrapped.merge(wrapped.init(), train=train), *args, backward=backward, **kwargs,
                                 **call_mode_kwargs(wrapped.module_type.__call__, train))
    return precision.explain(wrapped, *args, backward=backward, **kwargs, **mode_kwargs(wrapped, train))
