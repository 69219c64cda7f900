"""What a model is trained to do: its loss and metrics, built in or the user's.

A :class:`Task` maps the model's outputs and the batch to a float32 loss and
metrics. Built in: ``classification`` (one label per example) and
``language_model`` (one label per token), both softmax cross-entropy in
float32 with accuracy. A user's loss ``fn(outputs, batch) -> (loss, metrics)``
(named in a config as ``task: module:function``) works the same way: outputs
reach it in float32 (never a half-precision loss), it returns the batch mean
loss and a dict of batch-mean metrics; evaluation calls it per example, so
padded eval rows never count.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from precision.losses import cross_entropy
from train.references import UserCodeError, is_reference, resolve

__all__ = ["Task", "get_task", "builtin_task", "user_task", "cross_entropy", "describe_outputs", "TASK_NAMES"]

Metrics = dict[str, jax.Array]
LossFn = Callable[[Any, dict], tuple[jax.Array, Metrics]]

#: Metric names the train step reports itself; a user's loss may not return them.
RESERVED_METRICS = ("loss", "loss_scale", "grads_finite", "grad_norm", "skipped_steps", "nonfinite_streak",
                    "at_min_scale", "nonfinite_leaf", "learning_rate", "count", "correct")

#: Built-in task names (``lm`` is short for ``language_model``).
TASK_NAMES = ("auto", "classification", "language_model", "lm")


class Task(NamedTuple):
    """A loss with its metrics; ``builtin`` tasks take logits and integer labels.

    ``output`` picks what the loss reads from a model whose output is not one
    array: a key or attribute (``"logits"``: a dict, a Hugging Face ``ModelOutput``,
    a dataclass) or an index (a tuple); ``None`` reads the output as it is.
    """

    name: str
    loss_fn: LossFn
    builtin: bool
    output: str | int | None = None

    def select(self, outputs: Any) -> Any:
        """The part of the model's ``outputs`` the loss reads (see ``output``)."""
        if self.output is None:
            return outputs
        field = self.output
        try:
            if isinstance(field, int) or isinstance(outputs, Mapping):
                return outputs[field]
            return getattr(outputs, field)
        except (KeyError, IndexError, AttributeError, TypeError):
            raise UserCodeError(f"model.output: {field!r} is not in the model's output, "
                                f"{describe_outputs(outputs)}") from None

    def loss(self, outputs: Any, batch: dict) -> tuple[jax.Array, Metrics]:
        """Batch-mean float32 loss and metrics of ``outputs`` (cast to float32 first)."""
        return self._loss(_float32(self.select(outputs)), batch)

    def _loss(self, selected: Any, batch: dict) -> tuple[jax.Array, Metrics]:
        loss, metrics = self.loss_fn(selected, batch)
        return jnp.asarray(loss, jnp.float32), {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    def eval_sums(self, outputs: Any, batch: dict) -> Metrics:
        """Sums over the real (``mask``) examples of the loss (``loss_sum``) and the
        metrics (built-in: ``correct``; a user's: ``<name>_sum``), and ``count``
        (examples, or tokens for a language model), so batches add up exactly."""
        outputs = _float32(self.select(outputs))
        mask = batch.get("mask")
        if self.builtin:
            loss, correct = cross_entropy(outputs, batch["labels"])
            mask = jnp.ones(loss.shape[:1], bool) if mask is None else mask
            weights = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (loss.ndim - 1)), loss.shape)
            weights = weights.astype(jnp.float32)
            return {"loss_sum": jnp.sum(loss * weights), "correct": jnp.sum(correct * weights),
                    "count": jnp.sum(weights)}
        inputs = {k: v for k, v in batch.items() if k != "mask"}
        one = lambda x: x[None]  # noqa: E731 - each example as a batch of one
        losses, metrics = jax.vmap(lambda o, b: self._loss(jax.tree_util.tree_map(one, o),
                                                           jax.tree_util.tree_map(one, b)))(outputs, inputs)
        weights = jnp.ones(losses.shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
        sums = {f"{k}_sum": jnp.sum(v * weights) for k, v in metrics.items()}
        return {**sums, "loss_sum": jnp.sum(losses * weights), "count": jnp.sum(weights)}


def describe_outputs(outputs: Any) -> str:
    """A model's output in words, per example: ``an array (10,) float32``, ``a dict
    with logits (10,) float32, hidden (32,) float32``, ``a tuple with [0] ...``."""
    def array(x: Any) -> str:
        return f"{tuple(jnp.shape(x))[1:]} {getattr(x, 'dtype', type(x).__name__)}"

    if hasattr(outputs, "shape") and hasattr(outputs, "dtype"):
        return f"an array {array(outputs)}"
    if isinstance(outputs, Mapping):
        fields = list(outputs.items())
    elif isinstance(outputs, (tuple, list)):
        fields = [(f"[{i}]", x) for i, x in enumerate(outputs)]
    elif dataclasses.is_dataclass(outputs):
        fields = [(f.name, getattr(outputs, f.name)) for f in dataclasses.fields(outputs)]
    else:
        return f"a {type(outputs).__name__}"
    parts = [f"{k} {array(x)}" if hasattr(x, "shape") else f"{k} ({type(x).__name__})" for k, x in fields]
    return f"a {type(outputs).__name__} with {', '.join(parts) or 'nothing'}"


def _float32(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _cross_entropy_task(outputs: jax.Array, batch: dict) -> tuple[jax.Array, Metrics]:
    loss, correct = cross_entropy(outputs, batch["labels"])
    return loss.mean(), {"accuracy": correct.mean(dtype=jnp.float32)}


def get_task(spec: "str | Callable | Task" = "auto", data_task: str | None = None, key: str = "task",
             output: str | int | None = None) -> Task:
    """The task ``spec`` names: ``auto`` (the data's own), ``classification``,
    ``lm`` / ``language_model``, a reference ``module:function`` /
    ``file.py:function`` or a function ``fn(outputs, batch) -> (loss, metrics)``;
    ``output`` picks the field of the model's output it reads (see :class:`Task`).

    Raises:
      UserCodeError: naming ``key``, for an unknown name, a bad reference, or
        ``auto`` with data that declares no task.
    """
    if isinstance(spec, Task):
        return spec if output is None else spec._replace(output=output)
    if callable(spec):
        return Task(getattr(spec, "__name__", "custom"), spec, False, output)
    name = str(spec).strip()
    if name in TASK_NAMES:
        return builtin_task(name, data_task, key, output)
    if not is_reference(name):
        raise UserCodeError(f"{key}: unknown task {name!r}; valid: {', '.join(TASK_NAMES)}, or a loss "
                            f"module:function / path/to/file.py:function")
    fn = resolve(name, key)
    if not callable(fn):
        raise UserCodeError(f"{key}: {name} is a {type(fn).__name__}, not a function fn(outputs, batch) -> "
                            f"(loss, metrics)")
    return user_task(fn, name, key, output)


def builtin_task(name: str, data_task: str | None = None, key: str = "task",
                 output: str | int | None = None) -> Task:
    """The built-in task ``name`` (one of :data:`TASK_NAMES`; ``auto``: ``data_task``, the data's own).

    Raises:
      UserCodeError: naming ``key``, for ``auto`` with data that declares no task.
    """
    if name == "auto":
        if data_task not in ("classification", "language_model"):
            raise UserCodeError(f"{key}: auto, but the data declares no task ({data_task!r}); set {key} to "
                                f"classification, lm, or your loss as module:function")
        name = data_task
    return Task("language_model" if name == "lm" else name, _cross_entropy_task, True, output)


def user_task(fn: Callable, name: str, key: str = "task", output: str | int | None = None) -> Task:
    """The user's loss ``fn(outputs, batch) -> (loss, metrics)`` as a task named ``name``, its
    result checked each call (a scalar floating loss, scalar metrics under names of its own)."""
    return Task(name, _checked(fn, name, key), False, output)


def _checked(fn: Callable, name: str, key: str) -> LossFn:
    """``fn`` with its result checked to be ``(scalar loss, dict of scalar metrics)``."""

    def loss_fn(outputs: Any, batch: dict) -> tuple[jax.Array, Metrics]:
        result = fn(outputs, batch)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
            raise UserCodeError(f"{key}: {name} must return (loss, metrics dict), got {type(result).__name__}")
        loss, metrics = result
        reserved = sorted(set(metrics) & set(RESERVED_METRICS))
        if reserved:
            raise UserCodeError(f"{key}: {name} returns metrics named {reserved}, which the train step reports "
                                f"itself; rename them")
        dtype = getattr(loss, "dtype", None) or np.asarray(loss).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise UserCodeError(f"{key}: {name} returns a loss of dtype {dtype}: nothing can train on it (an "
                                f"{'integer' if jnp.issubdtype(dtype, jnp.integer) else dtype} loss has no "
                                f"gradient); compute it in floating point")
        shapes = {"loss": jnp.shape(loss), **{f"metrics[{k!r}]": jnp.shape(v) for k, v in metrics.items()}}
        bad = {k: s for k, s in shapes.items() if s != ()}
        if bad:
            raise UserCodeError(f"{key}: {name} must return scalars (batch means), got shapes {bad}")
        return loss, metrics

    return loss_fn
