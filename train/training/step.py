"""Jitted train and eval steps.

``train_step(state, batch) -> (state, metrics)``: the policy's forward pass,
outputs cast to float32 for the task's loss (never a half-precision softmax
cross-entropy), the loss scaled, gradients (accumulated over micro-batches in
one ``lax.scan`` when asked), then the mixed-precision optimizer: unscale,
finiteness check, skip or update, adjust the scale. No host sync; the state's
buffers are donated.
"""

from __future__ import annotations

import contextlib

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

import precision
from precision.stored import ACCUM_STREAM, step_key
from train.parallel.distributed import Layout, to_host
from train.training.forward import blockwise, forward_and_loss, mode, split_fp8
from train.finetune import merge
from train.training.state import ScaledGrads, TrainState
from train.data.model_inputs import call_arguments
from train.training.tasks import Task, cross_entropy, get_task  # noqa: F401 - cross_entropy re-exported

Metrics = dict[str, jax.Array]


def make_train_step(*, accum_steps: int = 1, learning_rate_fn: Callable[[Any], Any] | None = None,
                    donate: bool = True, train_kwarg: str | None = "auto", layout: Layout | None = None,
                    task: "str | Callable | Task" = "classification"
                    ) -> Callable[[TrainState, dict], tuple[TrainState, Metrics]]:
    """Builds the jitted ``train_step(state, batch) -> (state, metrics)``.

    Args:
      accum_steps: micro-batches per step. The batch (``inputs``, ``labels``) is
        split into this many equal micro-batches whose gradients are summed in
        float32 under one loss scale; the optimizer then runs once, with one
        finiteness check for the effective batch.
      learning_rate_fn: the optimizer's schedule, to report the learning rate of
        each step (evaluated at the number of applied, i.e. not skipped, steps).
      donate: donate the state's buffers to the step (update in place).
      train_kwarg: the keyword telling the model it is training: ``"auto"`` reads
        it from the model's signature (``train``, ``training``,
        ``deterministic``... or none; see :func:`train.mode_kwargs`), a name
        sets that keyword to ``True``, ``None`` passes none. NNX models switch
        to training mode whatever this says.
      layout: the device mesh and sharding of state and batch (see
        :mod:`train.parallel.distributed`); ``None`` runs where the arrays are. Under a
        layout, each micro-batch is spread over every device, gradients take the
        params' sharding, and the finiteness check and the loss scale are global.
      task: the loss and its metrics (see :func:`train.get_task`): softmax
        cross-entropy by default (per example or per token), or a function
        ``fn(outputs, batch) -> (loss, metrics)``.

    Metrics: ``loss`` (unscaled, mean over the batch), the task's metrics
    (``accuracy`` for the built-in ones),
    ``loss_scale`` (the scale this step used), ``grads_finite`` (the step was
    applied: gradients and loss finite), ``grad_norm`` (of the unscaled
    gradients), ``skipped_steps`` (total), ``nonfinite_streak``, ``at_min_scale``
    (this step's scale was the lowest the loss scale allows), ``nonfinite_leaf``
    (index of the first param leaf whose gradient was not finite; ``-2 - i`` when
    only the global norm overflowed, leaf ``i`` the largest; -1 otherwise) and
    ``learning_rate``.
    """
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an integer >= 1, got {accum_steps!r}")
    task = get_task(task)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, Metrics]:
        lay = step_layout(layout, state, "make_train_step")
        if lay is not None:
            batch = lay.constrain_batch(batch)
        loss_scale = precision.current_loss_scale(state.opt_state)
        rng = jax.random.fold_in(state.rng, state.step)
        grads, fp8_state, loss, task_metrics, model_state = _gradients(
            _loss_fn(lay, task, train_kwarg), state, batch, rng, loss_scale, accum_steps, lay)
        if lay is not None:
            grads = lay.constrain_state(grads)
        # the loss, checked with the gradients (a non-finite loss skips the step too)
        new_state = state.apply_gradients(grads=ScaledGrads(grads, loss, sharded=lay is not None and lay.splits_params))
        opt_state = new_state.opt_state
        new_state = new_state.replace(model_state=_with_fp8_state(model_state, fp8_state, state, opt_state))
        metrics = {**task_metrics, "loss": loss, **_optimizer_metrics(loss_scale, opt_state)}
        if learning_rate_fn is not None:
            applied = state.step - loss_scale.skipped_steps
            metrics["learning_rate"] = jnp.asarray(learning_rate_fn(applied), jnp.float32)
        if lay is not None:
            new_state = lay.constrain_state(new_state)
            metrics = jax.lax.with_sharding_constraint(metrics, lay.replicated())
        return new_state, metrics

    return _LaidOutStep(jax.jit(train_step, donate_argnums=(0,) if donate else ()), layout, "make_train_step")


def _loss_fn(layout: Layout | None, task: Task, train_kwarg: str | None) -> Callable:
    def loss_fn(params, fp8_state, model_state, batch, rng, state, loss_scale, gather_dtypes=None):
        """The scaled loss of one (micro-)batch, and (loss, task metrics, new model state); the
        gradient with respect to ``fp8_state`` (FP8 amax histories, or None) is their new value.
        FSDP-split params are gathered in ``gather_dtypes`` (see :func:`_gather_dtypes`)."""
        if layout is not None:
            params = layout.gather(params, gather_dtypes)
        forward = blockwise(forward_and_loss(state, task, train_kwarg, list(model_state)), state, layout)
        with layout.computing() if layout is not None else contextlib.nullcontext():
            loss, task_metrics, new_model_state = forward(params, fp8_state, model_state, batch, rng)
        return loss_scale.scale(loss), (loss, task_metrics, new_model_state)

    return loss_fn


def step_layout(given: Layout | None, state: TrainState, what: str) -> Layout | None:
    """The layout a step runs ``state`` in: the one given, else the one the state was
    created in (``create_train_state(..., layout=)``); the two must agree."""
    own = getattr(state, "layout", None)
    if given is not None and own is not None and given.tensor_plan is None and given.with_plan(own.tensor_plan) == own:
        return own  # the layout the state was created in, and the plan it found for its params
    if given is not None and own is not None and given != own:
        raise ValueError(f"{what}: layout= (mesh {dict(given.mesh.shape)}) is not the layout the state was created "
                         f"in (mesh {dict(own.mesh.shape)}); pass the state's (state.layout) or none")
    return given if given is not None else own


class _LaidOutStep:
    """A jitted step that refuses a state split over devices with no layout to run it in:
    without one XLA would gather activations across devices (and say so only in a warning)."""

    def __init__(self, jitted: Callable, layout: Layout | None, what: str):
        self._jitted, self._layout, self._what = jitted, layout, what

    def _check(self, state: Any) -> None:
        if self._layout is not None or getattr(state, "layout", None) is not None:
            return
        for leaf in jax.tree_util.tree_leaves(getattr(state, "params", None)):
            sharding = getattr(leaf, "sharding", None)
            if isinstance(leaf, jax.core.Tracer) or sharding is None or len(sharding.device_set) <= 1:
                continue
            mesh = getattr(sharding, "mesh", None)
            where = f"a mesh {dict(mesh.shape)}" if mesh is not None else f"{len(sharding.device_set)} devices"
            raise ValueError(f"{self._what}: this state's params are split over {where}, and the step has no layout "
                             f"to run them in (XLA would gather activations across devices): pass the layout the "
                             f"state was placed with, {self._what}(layout=layout), or create the state with "
                             f"create_train_state(..., layout=layout)")

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        self._check(state)
        return self._jitted(state, *args, **kwargs)

    def lower(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        self._check(state)
        return self._jitted.lower(state, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the jitted function's own (trace, eval_shape, ...)
        return getattr(self._jitted, name)


def _gather_dtypes(forward: Callable[[Any], Any], params: Any, layout: Layout | None) -> Any:
    """Under FSDP, the dtype each param is all-gathered in: the one ``forward(params)``
    reads it in (:func:`precision.read_dtypes`). A param the policy only uses in
    bfloat16 travels in bfloat16; one a norm or a rule keeps in float32, in float32.
    The gradients are unchanged: the cast's derivative brings them back to float32."""
    if layout is None or not layout.splits_params:
        return None
    return precision.read_dtypes(forward, params)


def _with_fp8_state(model_state: Any, fp8_state: Any, state: TrainState, opt_state: Any) -> Any:
    """``model_state`` with the FP8 amax histories the step recorded; a skipped step keeps the old ones."""
    if fp8_state is None:
        return model_state
    applied = precision.find_mixed_precision_state(opt_state).grads_finite
    old = state.model_state[precision.FP8_COLLECTION]
    return {**model_state, precision.FP8_COLLECTION: precision.select_tree(applied, fp8_state, old)}


def _gradients(loss_fn: Callable, state: TrainState, batch: dict, rng: jax.Array, loss_scale: Any,
               accum_steps: int, layout: Layout | None) -> tuple[Any, Any, jax.Array, Metrics, Any]:
    """Gradients of the scaled loss over ``batch`` (summed over ``accum_steps``
    micro-batches in one ``lax.scan``, in float32 or the policy's ``accum`` dtype,
    bfloat16 with stochastic rounding; then averaged in float32), the new
    FP8 amax histories (the max over micro-batches; None without them), the
    mean loss and task metrics, and the new model state."""
    fp8_state, model_state = split_fp8(state.model_state)
    dtypes = _gather_dtypes(lambda p: loss_fn(p, fp8_state, model_state, batch, rng, state, loss_scale)[0],
                            state.params, layout)
    loss_fn = functools.partial(loss_fn, gather_dtypes=dtypes)
    if state.frozen:  # differentiated with respect to the trained params only: frozen ones get no gradient
        loss_fn = _on_trained(loss_fn, state.params)
    trained = state.trained_params
    grad_fn = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)
    if accum_steps == 1:
        (grads, new_fp8), (loss, metrics, model_state) = grad_fn(trained, fp8_state, model_state, batch, rng,
                                                                 state, loss_scale)
        return grads, new_fp8, loss, metrics, model_state
    leading = jax.tree_util.tree_leaves(batch)[0].shape[0]
    if leading % accum_steps:
        raise ValueError(f"batch size {leading} is not divisible by accum_steps={accum_steps}")
    # Micro-batch i takes rows i, i + accum_steps, ...: a strided split keeps
    # every micro-batch spread over all the devices the batch is split over.
    micro = jax.tree_util.tree_map(
        lambda x: jnp.swapaxes(x.reshape((leading // accum_steps, accum_steps) + x.shape[1:]), 0, 1), batch)

    def body(carry, xs):
        grads_sum, fp8_max, model_state, sums = carry
        mb, i = xs
        (grads, new_fp8), (loss, metrics, model_state) = grad_fn(trained, fp8_state, model_state, mb,
                                                                 jax.random.fold_in(rng, i), state, loss_scale)
        grads_sum = precision.accumulate(grads_sum, grads, step_key(state.step, i, ACCUM_STREAM))
        fp8_max = None if fp8_max is None else precision.combine_fp8_states(fp8_max, new_fp8)
        return (grads_sum, fp8_max, model_state, jax.tree_util.tree_map(jnp.add, sums, (loss, metrics))), None

    accum_dtype = state.policy.accum_dtype or jnp.float32
    zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, accum_dtype), trained)
    first = jax.tree_util.tree_map(lambda x: x[0], micro)
    # The forward pass alone gives the shapes of the loss and metrics to sum (no backward trace).
    shapes = jax.eval_shape(lambda: loss_fn(trained, fp8_state, model_state, first, rng, state, loss_scale))
    sums = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[1][:2])
    fp8_zeros = None if fp8_state is None else jax.tree_util.tree_map(jnp.zeros_like, fp8_state)
    (grads, new_fp8, model_state, (loss, metrics)), _ = jax.lax.scan(
        body, (zeros, fp8_zeros, model_state, sums), (micro, jnp.arange(accum_steps)))
    mean = lambda tree: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) / accum_steps, tree)  # noqa: E731
    return mean(grads), new_fp8, mean(loss), mean(metrics), model_state


def _on_trained(loss_fn: Callable, params: Any) -> Callable:
    """``loss_fn`` taking the trained params (``None`` where frozen), the frozen ones from ``params``."""
    def on_trained(trained: Any, *args: Any, **kwargs: Any) -> Any:
        return loss_fn(merge(trained, params), *args, **kwargs)

    return on_trained


def _optimizer_metrics(loss_scale: Any, opt_state: Any) -> Metrics:
    """What the mixed-precision optimizer did this step: the scale it used, the
    finiteness check, the gradient norm, skips, and where a gradient went non-finite."""
    mp = precision.find_mixed_precision_state(opt_state)
    new_scale = mp.loss_scale
    return {
        "loss_scale": loss_scale.loss_scale.astype(jnp.float32),
        "grads_finite": mp.grads_finite,
        "grad_norm": mp.grad_norm,
        "skipped_steps": new_scale.skipped_steps,
        "nonfinite_streak": new_scale.nonfinite_streak,
        "at_min_scale": _at_min_scale(loss_scale),  # the scale this step used
        "nonfinite_leaf": mp.nonfinite_leaf,
    }


def make_multi_step(train_step: Callable[[TrainState, dict], tuple[TrainState, Metrics]], steps_per_call: int,
                    *, donate: bool = True) -> Callable[[TrainState, dict, Any], tuple[TrainState, Metrics]]:
    """Builds the jitted ``multi_step(state, batches, count) -> (state, metrics)``:
    ``count`` (at most ``steps_per_call``) consecutive ``train_step`` calls in one
    device program.

    For models whose step takes about as long as the host needs to launch it (a
    millisecond or less), one call per step leaves the device waiting on Python.
    Here the host launches, transfers batches and reads metrics once per
    ``steps_per_call`` steps. Every step is the same computation as
    ``train_step`` (its dropout key is still folded from the step number), so a
    run's result does not depend on how its steps were grouped into calls: bit
    for bit on CPU (tested); elsewhere as far as XLA compiles the step inside
    the loop as it does alone (a GPU's autotuning may pick other kernels).

    ``batches`` stacks ``steps_per_call`` batches along a new leading axis (see
    :func:`train.data.train_batch_stack`); those past ``count`` are ignored, so
    a call of fewer steps (up to an evaluation or a checkpoint) needs no second
    program. ``metrics`` are ``train_step``'s, stacked: entry ``i`` is step ``i``'s
    for ``i < count``, zeros after.
    """
    if not isinstance(steps_per_call, int) or steps_per_call < 1:
        raise ValueError(f"steps_per_call must be an integer >= 1, got {steps_per_call!r}")

    def multi_step(state: TrainState, batches: dict, count: Any) -> tuple[TrainState, Metrics]:
        length = jax.tree_util.tree_leaves(batches)[0].shape[0]
        if length != steps_per_call:
            raise ValueError(f"multi_step: batches stack {length} batches, expected steps_per_call={steps_per_call}")

        def take(i):
            return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), batches)

        shapes = jax.eval_shape(train_step, state, take(0))[1]
        stacked = jax.tree_util.tree_map(lambda m: jnp.zeros((steps_per_call,) + m.shape, m.dtype), shapes)

        def body(i, carry):
            state, stacked = carry
            state, metrics = train_step(state, take(i))
            return state, jax.tree_util.tree_map(lambda buf, m: buf.at[i].set(m), stacked, metrics)

        return jax.lax.fori_loop(0, jnp.minimum(count, steps_per_call), body, (state, stacked))

    return jax.jit(multi_step, donate_argnums=(0,) if donate else ())


def _at_min_scale(loss_scale: Any) -> jax.Array:
    """Whether ``loss_scale`` is at its minimum (no lower scale is left to try)."""
    minimum = getattr(loss_scale, "min_loss_scale", None)
    if minimum is None:  # none / static: the scale never moves, so it is its own minimum
        return jnp.array(True)
    return loss_scale.loss_scale <= minimum


def make_eval_step(*, train_kwarg: str | None = "auto", layout: Layout | None = None,
                   task: "str | Callable | Task" = "classification") -> Callable[[TrainState, dict], Metrics]:
    """Builds the jitted ``eval_step(state, batch) -> sums``, computing in the
    policy of ``state.model`` (over the devices of ``layout``, when given).

    Returns sums over the real (``mask``) examples, so batches add up exactly:
    ``loss_sum``, the task's metrics (``correct`` for the built-in tasks,
    ``<metric>_sum`` for a user's) and ``count`` (examples, or tokens for
    sequences). Turn them into means with :func:`summarize_eval`.
    """
    task = get_task(task)

    def eval_step(state: TrainState, batch: dict) -> Metrics:
        eval_mode = mode(state.model, False, train_kwarg)
        lay = step_layout(layout, state, "make_eval_step")

        def forward(params):
            args, kwargs = call_arguments(batch["inputs"], state.inputs_as)
            return state.model.apply({"params": params, **state.model_state}, *args, **kwargs, **eval_mode)

        params = _evaluated(state)
        if lay is not None:
            batch = lay.constrain_batch(batch)
            params = lay.gather(params, _gather_dtypes(forward, params, lay))
        with lay.computing() if lay is not None else contextlib.nullcontext():
            sums = blockwise(lambda p, b: task.eval_sums(forward(p), b), state, lay)(params, batch)
        return sums if lay is None else jax.lax.with_sharding_constraint(sums, lay.replicated())

    return _LaidOutStep(jax.jit(eval_step), layout, "make_eval_step")


def _evaluated(state: TrainState) -> Any:
    """The params an eval step computes with: ``state.params``, or a schedule-free optimizer's
    average in their dtypes (its gradients are taken elsewhere, :mod:`precision.evaluation`)."""
    if not precision.keeps_evaluation_point(state.opt_state):
        return state.params
    return jax.tree_util.tree_map(lambda x, p: x.astype(p.dtype),
                                  precision.evaluation_params(state.params, state.opt_state), state.params)


def summarize_eval(sums: dict[str, Any], task: str = "classification") -> dict[str, float]:
    """Means from summed eval results: loss, accuracy (or a user task's metrics),
    plus perplexity for language models."""
    count = max(float(sums["count"]), 1.0)
    loss = float(sums["loss_sum"]) / count
    out = {"loss": loss}
    if "correct" in sums:
        out["accuracy"] = float(sums["correct"]) / count
    out.update({k.removesuffix("_sum"): float(v) / count for k, v in sums.items()
                if k.endswith("_sum") and k != "loss_sum"})
    if task == "language_model":
        out["perplexity"] = float(jnp.exp(jnp.minimum(loss, 80.0)))
    return out


def evaluate(eval_step: Callable, state: TrainState, batches: Any, task: str = "classification"
             ) -> dict[str, float]:
    """Runs ``eval_step`` over ``batches`` and returns the means."""
    total = None
    for batch in batches:
        sums = eval_step(state, batch)
        total = sums if total is None else jax.tree_util.tree_map(jnp.add, total, sums)
    if total is None:
        raise ValueError("evaluate: no eval batches")
    return summarize_eval(to_host(total), task)
