"""Jitted train and eval steps.

``train_step(state, batch) -> (state, metrics)``: the policy's forward pass,
logits cast to float32 for the loss (never a half-precision softmax
cross-entropy), the loss scaled, gradients (accumulated over micro-batches in
one ``lax.scan`` when asked), then the mixed-precision optimizer: unscale,
finiteness check, skip or update, adjust the scale. No host sync; the state's
buffers are donated.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import precision
from train.distributed import Layout, to_host
from train.state import TrainState

Metrics = dict[str, jax.Array]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-example (or per-token) float32 cross-entropy and correctness."""
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss, (jnp.argmax(logits, -1) == labels)


def make_train_step(*, accum_steps: int = 1, learning_rate_fn: Callable[[Any], Any] | None = None,
                    donate: bool = True, train_kwarg: str | None = "train", layout: Layout | None = None
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
      train_kwarg: the keyword telling the model it is training (``None`` if it
        takes none).
      layout: the device mesh and sharding of state and batch (see
        :mod:`train.distributed`); ``None`` runs where the arrays are. Under a
        layout, each micro-batch is spread over every device, gradients take the
        params' sharding, and the finiteness check and the loss scale are global.

    Metrics: ``loss`` (unscaled, mean over the batch), ``accuracy``,
    ``loss_scale`` (the scale this step used), ``grads_finite``, ``grad_norm``
    (of the unscaled gradients), ``skipped_steps`` (total), ``nonfinite_streak``,
    ``at_min_scale``, ``nonfinite_leaf`` (index of the first param leaf whose
    gradient was not finite, -1 if all were) and ``learning_rate``.
    """
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an integer >= 1, got {accum_steps!r}")

    def loss_fn(params, model_state, batch, rng, state, loss_scale):
        if layout is not None:
            params = layout.gather(params)
        variables = {"params": params, **model_state}
        kwargs = {train_kwarg: True} if train_kwarg else {}
        mutable = list(model_state)
        out = state.model.apply(variables, batch["inputs"], rngs={"dropout": rng}, mutable=mutable or False,
                                **kwargs)
        logits, new_model_state = out if mutable else (out, model_state)
        loss, correct = cross_entropy(logits, batch["labels"])
        loss = loss.mean()
        return loss_scale.scale(loss), (loss, correct.mean(dtype=jnp.float32), new_model_state)

    grad_fn = jax.grad(loss_fn, has_aux=True)

    def accumulate(state, batch, rng, loss_scale):
        leading = jax.tree_util.tree_leaves(batch)[0].shape[0]
        if leading % accum_steps:
            raise ValueError(f"batch size {leading} is not divisible by accum_steps={accum_steps}")
        # Micro-batch i takes rows i, i + accum_steps, ...: a strided split keeps
        # every micro-batch spread over all the devices the batch is split over.
        micro = jax.tree_util.tree_map(
            lambda x: jnp.swapaxes(x.reshape((leading // accum_steps, accum_steps) + x.shape[1:]), 0, 1), batch)

        def body(carry, xs):
            grads_sum, model_state, loss_sum, acc_sum = carry
            mb, i = xs
            grads, (loss, acc, model_state) = grad_fn(state.params, model_state, mb,
                                                      jax.random.fold_in(rng, i), state, loss_scale)
            grads_sum = jax.tree_util.tree_map(lambda s, g: s + g.astype(jnp.float32), grads_sum, grads)
            return (grads_sum, model_state, loss_sum + loss, acc_sum + acc), None

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        init = (zeros, state.model_state, jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32))
        (grads, model_state, loss, acc), _ = jax.lax.scan(body, init, (micro, jnp.arange(accum_steps)))
        grads = jax.tree_util.tree_map(lambda g: g / accum_steps, grads)
        return grads, loss / accum_steps, acc / accum_steps, model_state

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, Metrics]:
        if layout is not None:
            batch = layout.constrain_batch(batch)
        loss_scale = precision.current_loss_scale(state.opt_state)
        rng = jax.random.fold_in(state.rng, state.step)
        if accum_steps == 1:
            grads, (loss, acc, model_state) = grad_fn(state.params, state.model_state, batch, rng, state,
                                                      loss_scale)
        else:
            grads, loss, acc, model_state = accumulate(state, batch, rng, loss_scale)
        if layout is not None:
            grads = layout.constrain_state(grads)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        mp = precision.find_mixed_precision_state(opt_state)
        new_scale = mp.loss_scale
        metrics = {
            "loss": loss,
            "accuracy": acc,
            "loss_scale": loss_scale.loss_scale.astype(jnp.float32),
            "grads_finite": mp.grads_finite,
            "grad_norm": mp.grad_norm,
            "skipped_steps": new_scale.skipped_steps,
            "nonfinite_streak": new_scale.nonfinite_streak,
            "at_min_scale": _at_min_scale(new_scale),
            "nonfinite_leaf": mp.nonfinite_leaf,
        }
        if learning_rate_fn is not None:
            applied = state.step - loss_scale.skipped_steps
            metrics["learning_rate"] = jnp.asarray(learning_rate_fn(applied), jnp.float32)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  model_state=model_state)
        if layout is not None:
            new_state = layout.constrain_state(new_state)
            metrics = jax.lax.with_sharding_constraint(metrics, layout.replicated())
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=(0,) if donate else ())


def _at_min_scale(loss_scale: Any) -> jax.Array:
    minimum = getattr(loss_scale, "min_loss_scale", None)
    if minimum is None:  # none / static: the scale never moves, so it is its own minimum
        return jnp.array(True)
    return loss_scale.loss_scale <= minimum


def make_eval_step(*, train_kwarg: str | None = "train", layout: Layout | None = None
                   ) -> Callable[[TrainState, dict], Metrics]:
    """Builds the jitted ``eval_step(state, batch) -> sums``, computing in the
    policy of ``state.model`` (over the devices of ``layout``, when given).

    Returns sums over the real (``mask``) examples, so batches add up exactly:
    ``loss_sum``, ``correct`` and ``count`` (examples, or tokens for sequences).
    Turn them into means with :func:`summarize_eval`.
    """

    def eval_step(state: TrainState, batch: dict) -> Metrics:
        params = state.params
        if layout is not None:
            batch = layout.constrain_batch(batch)
            params = layout.gather(params)
        variables = {"params": params, **state.model_state}
        kwargs = {train_kwarg: False} if train_kwarg else {}
        logits = state.model.apply(variables, batch["inputs"], **kwargs)
        loss, correct = cross_entropy(logits, batch["labels"])
        mask = batch.get("mask")
        mask = jnp.ones(loss.shape[:1], bool) if mask is None else mask
        weights = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (loss.ndim - 1)), loss.shape)
        weights = weights.astype(jnp.float32)
        sums = {"loss_sum": jnp.sum(loss * weights), "correct": jnp.sum(correct * weights),
                "count": jnp.sum(weights)}
        return sums if layout is None else jax.lax.with_sharding_constraint(sums, layout.replicated())

    return jax.jit(eval_step)


def summarize_eval(sums: dict[str, Any], task: str = "classification") -> dict[str, float]:
    """Means from summed eval results: loss and accuracy, plus perplexity for language models."""
    count = max(float(sums["count"]), 1.0)
    loss = float(sums["loss_sum"]) / count
    out = {"loss": loss, "accuracy": float(sums["correct"]) / count}
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
