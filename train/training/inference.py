"""Half-precision inference: serve a trained state in float16 or bfloat16 and
measure what it costs in accuracy against float32."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax.numpy as jnp

import precision
from train.training.binding import cast_variables, rebind
from train.parallel.distributed import Layout
from train.training.state import TrainState
from train.training.step import evaluate, make_eval_step
from train.training.tasks import Task, get_task


def full_precision_params(state: TrainState) -> Any:
    """The float32 params to serve from a state: the master copy when params are stored in
    half, at a schedule-free optimizer's average (:func:`precision.evaluation_params`)."""
    return precision.evaluation_params(state.params, state.opt_state)


def cast_for_inference(state: TrainState, dtype: Any, rules: Any = None) -> TrainState:
    """The state with params stored and computed in ``dtype`` (outputs float32).

    ``rules`` default to the training model's rules, so normalization layers
    stay float32 (and BatchNorm statistics always do); float32 matmuls keep the
    training policy's precision (``matmul=highest``).
    """
    matmul = getattr(getattr(state.model, "policy", None), "matmul_precision", "default")
    policy = precision.Policy(dtype, dtype, jnp.float32, matmul_precision=matmul)
    model = rebind(state.model, policy, rules)
    params = cast_variables(model, {"params": full_precision_params(state)})["params"]
    return state.replace(model=model, params=params)


def inference_report(state: TrainState, batches: Callable[[], Iterable[dict]], task: "str | Task" = "classification",
                     dtypes: Iterable[str] = ("float16", "bfloat16"), layout: Layout | None = None
                     ) -> dict[str, dict[str, float]]:
    """Eval metrics of the trained params served in float32 and in each half ``dtype``.

    Returns ``{dtype: {"loss", "accuracy", ["perplexity"], "accuracy_delta"}}``
    where ``accuracy_delta`` is the half-precision accuracy minus float32's
    (a user's task gives its own metrics and no delta).
    ``layout``: the mesh the state and batches are on (see :mod:`train.parallel.distributed`).
    """
    task = get_task(task)
    eval_step = make_eval_step(layout=layout, task=task)
    report = {}
    for dtype in ("float32", *dtypes):
        report[dtype] = evaluate(eval_step, cast_for_inference(state, dtype), batches(), task.name)
    for dtype in dtypes:
        if "accuracy" in report[dtype]:
            report[dtype]["accuracy_delta"] = report[dtype]["accuracy"] - report["float32"]["accuracy"]
    return report
