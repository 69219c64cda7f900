"""A train step's forward pass and its loss: the model in training (or evaluation) mode on
a batch's inputs, the task's loss of its outputs, and that loss from large logits computed
a block of rows at a time (:func:`precision.blockwise_loss`) unless the model's op lists
turn it off; :func:`blockwise_plan` says what a step does with it (``--explain``,
``--compile-for``)."""

from __future__ import annotations

from typing import Any, Callable

import jax

import precision
import precision.blockwise as blockwise_module
from train.data.model_inputs import call_arguments
from train.parallel.distributed import Layout
from train.training.binding import TRAIN_KEYWORDS, NNXModel, mode_kwargs
from train.training.state import TrainState
from train.training.tasks import Task, get_task

__all__ = ["blockwise", "blockwise_plan", "forward_and_loss", "mode", "split_fp8"]


def mode(model: Any, train: bool, train_kwarg: str | None) -> dict[str, bool]:
    """The keyword arguments that put ``model`` in training (or evaluation) mode: ``train_kwarg``
    (``auto``: the one its ``__call__`` takes, if any; NNX models: ``model.train()`` / ``eval()``)."""
    if train_kwarg == "auto" or isinstance(model, NNXModel):
        return mode_kwargs(model, train)
    if not train_kwarg:
        return {}
    return {train_kwarg: train if TRAIN_KEYWORDS.get(train_kwarg, True) else not train}  # deterministic: inverted


def forward_and_loss(state: TrainState, task: Task, train_kwarg: str | None, mutable: list) -> Callable:
    """``(params, fp8_state, model_state, batch, rng) -> (loss, task metrics, new model state)``:
    the model in training mode on the batch's inputs, and the task's loss of its outputs."""

    def forward_and_loss(params, fp8_state, model_state, batch, rng):
        fp8 = {} if fp8_state is None else {precision.FP8_COLLECTION: fp8_state}
        args, kwargs = call_arguments(batch["inputs"], state.inputs_as)
        out = state.model.apply({"params": params, **model_state, **fp8}, *args, rngs={"dropout": rng},
                                mutable=mutable or False, **kwargs, **mode(state.model, True, train_kwarg))
        outputs, new_model_state = out if mutable else (out, model_state)
        new_model_state = {k: v for k, v in new_model_state.items() if k != precision.FP8_COLLECTION}
        return (*task.loss(outputs, batch), new_model_state)

    return forward_and_loss


def blockwise(fn: Callable, state: TrainState, layout: Layout | None) -> Callable:
    """``fn`` (a forward and its loss) with a loss from large logits computed a block of rows
    at a time (:func:`precision.blockwise_loss`) as the model's op lists say
    (``precision.op_lists(blockwise_loss=)``: ``"auto"`` from 8 GiB of float32 logits, ``"on"``
    from 256 MiB, ``"off"``); no block crosses the devices the batch is split over."""
    threshold = _threshold(state)
    if threshold is None:
        return fn
    return precision.blockwise_loss(fn, min_logits_bytes=threshold,
                                    row_multiple=layout.data_shards if layout is not None else 1)


def blockwise_plan(state: TrainState, batch: dict, *, task: "str | Callable | Task" = "classification",
                   accum_steps: int = 1, layout: Layout | None = None,
                   train_kwarg: str | None = "auto") -> precision.BlockwisePlan:
    """What :func:`train.make_train_step`'s step does with a loss from large logits (computed a
    block of rows at a time, or why not; :func:`precision.plan_blockwise_loss`), for ``batch``
    (abstract arrays will do) split into ``accum_steps`` micro-batches. For ``--explain``
    and ``--compile-for``."""
    threshold = _threshold(state)
    if threshold is None:
        return precision.BlockwisePlan(False, "turned off (precision.blockwise_loss=false)")
    micro = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // accum_steps, *x.shape[1:]), x.dtype), batch)
    fp8_state, model_state = split_fp8(state.model_state)
    fn = forward_and_loss(state, get_task(task), train_kwarg, list(model_state))
    plan = precision.plan_blockwise_loss(fn, state.params, fp8_state, model_state, micro, state.rng,
                                         min_logits_bytes=threshold,
                                         row_multiple=layout.data_shards if layout is not None else 1)
    if not plan.found and _mode_of(state) == "auto" and "whole is cheaper" in plan.reason:
        plan = plan._replace(reason=f"{plan.reason}; precision.blockwise_loss=true computes logits from "
                                    f"{blockwise_module.MIN_LOGITS_BYTES / 2**20:.0f} MiB in blocks")
    return plan


def _mode_of(state: TrainState) -> str:
    ops = getattr(state.model, "ops", None)
    return ops.blockwise_loss if ops is not None else "auto"


def _threshold(state: TrainState) -> int | None:
    """The float32 logits bytes from which the step computes its loss in blocks (None: never)."""
    return blockwise_module.min_logits_bytes(_mode_of(state))


def split_fp8(model_state: Any) -> tuple[Any, Any]:
    """(FP8 amax histories or None, the rest of the model state)."""
    return (model_state.get(precision.FP8_COLLECTION),
            {k: v for k, v in model_state.items() if k != precision.FP8_COLLECTION})
