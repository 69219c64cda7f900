"""``python -m train CONFIG --explain``: what the experiment's policy does to its model.

Builds the experiment's data and model as :func:`train.run` would and traces
one training step's forward and backward pass (abstractly: nothing is
computed, no workdir is touched) with :func:`precision.explain`. On a mesh of
more than one device it also builds the train state in its layout and
compiles (does not run) one train step, to list what the step sends between
devices (:func:`train.explain_communication`).
"""

from __future__ import annotations

import jax

import precision
from train import config as config_lib
from train.config import ExperimentConfig
from train.training.binding import bind, inputs_as_for
from train.experiment.builders import build_train_state, finetune_from
from train.parallel.communication import CommunicationReport, explain_communication, module_paths
from train.parallel.distributed import crossing_axes
from train.experiment.loop import accumulation_dtype, build_experiment, layout_of, state_note
from train.training.state import explain_model
from train.training.forward import blockwise_plan
from train.training.step import make_train_step
from train.finetune import finetune_model, finetune_note

__all__ = ["explain_experiment", "explain_experiment_communication", "explain_experiment_layout", "explain_experiment_loss",
           "explain_experiment_state"]

#: The stored-state presets ``--explain`` prices against the experiment's own policy.
STATE_ALTERNATIVES = ("mixed_bf16", "lean_bf16", "lean_int8")


def explain_experiment(config: ExperimentConfig, experiment: tuple | None = None) -> precision.Explanation:
    """The :class:`precision.Explanation` of the model ``config`` trains, on one
    training micro-batch, under its policy, rules and op lists."""
    data, _, model = experiment or build_experiment(config)
    sample = data.sample_input(config.data.batch_size)
    inputs_as = inputs_as_for(model, sample, config.data.inputs_as)
    model = finetune_model(model, finetune_from(config.finetune), sample, inputs_as)  # its adapters explained too
    wrapped = bind(model, config.precision.policy, config.precision.rules,
                   ops=config_lib.build_op_lists(config.precision), autocast=config.precision.autocast,
                   fp8=config.precision.fp8.options(), int8=config.precision.int8.options())
    return explain_model(wrapped, sample, train=True, backward=True, inputs_as=inputs_as)


def explain_experiment_communication(config: ExperimentConfig, experiment: tuple | None = None
                                     ) -> CommunicationReport | None:
    """The collectives of one train step of ``config`` on its mesh (None on one device).
    ``experiment``: its (data, task, model), when already built."""
    layout = layout_of(config)
    if layout.mesh.devices.size == 1:
        return None
    data, task, model = experiment or build_experiment(config)
    state, _ = build_train_state(config, model, data, layout)
    step = make_train_step(accum_steps=config.accum_steps, layout=layout, task=task, donate=False)
    size = config.data.batch_size * config.accum_steps
    batch = layout.global_batch(data.train_batch(0, size, config.seed), size)
    return explain_communication(step, state, batch)._replace(modules=module_paths(state.params))


def explain_experiment_layout(config: ExperimentConfig, experiment: tuple | None = None) -> str | None:
    """The mesh (which of its axes cross hosts) and, under ``mesh.tensor`` or ``sharding.rules``,
    each param's layout: split over ``tensor`` along which dimension and why, or whole and why
    (:mod:`train.parallel.tensor`). None on one device. Abstract: nothing is allocated."""
    layout = layout_of(config)
    if layout.mesh.devices.size == 1:
        return None
    shape = " ".join(f"{k}={v}" for k, v in dict(layout.mesh.shape).items())
    crossing = crossing_axes(layout.mesh)
    hosts = (f"{', '.join(crossing)} cross{'es' if len(crossing) == 1 else ''} hosts" if crossing
             else "no axis crosses hosts (one process)" if jax.process_count() == 1 else "no axis crosses hosts")
    lines = [f"Mesh {shape} over {layout.mesh.devices.size} devices: {hosts}; tensor is innermost (adjacent devices)"]
    if layout.needs_plan:
        data, _, model = experiment or build_experiment(config)
        state = jax.eval_shape(lambda: build_train_state(config, model, data, layout)[0])
        sequence = "split along the sequence" if layout.sequence_parallel else "whole"
        lines += state.layout.tensor_plan.lines()
        lines.append(f"  between the split layers activations are {sequence} over tensor; split sums in "
                     f"{config.precision.tensor_reduce_dtype} (precision.tensor_reduce_dtype)")
    return "\n".join(lines)


def explain_experiment_state(config: ExperimentConfig, experiment: tuple | None = None) -> str:
    """What the train state of ``config`` stores per parameter, by part (the run's header
    line), and the total under each of :data:`STATE_ALTERNATIVES` with the same model,
    optimizer and accumulation. Abstract: shapes and dtypes only, nothing allocated."""
    data, _, model = experiment or build_experiment(config)

    def abstract_state(policy: str):
        cfg = config.model_copy(update={"precision": config.precision.model_copy(update={"policy": policy})})
        return jax.eval_shape(lambda: build_train_state(cfg, model, data)[0])

    state = abstract_state(config.precision.policy)
    lines = [state_note(state, config.accum_steps)]
    if (tuned := finetune_note(state.params, state.frozen)) is not None:
        lines.append(tuned)
    for name in STATE_ALTERNATIVES:
        if precision.get_policy(name) != state.policy:
            other = abstract_state(name)
            accum = accumulation_dtype(other.policy, config.accum_steps)
            total = precision.state_bytes(other.params, other.opt_state, accum)["total"]
            lines.append(f"  under {name}: {total:.1f} bytes/param")
    return "\n".join(lines)


def explain_experiment_loss(config: ExperimentConfig, experiment: tuple | None = None) -> str:
    """How one train step of ``config`` computes its loss from the model's logits: a block of
    rows at a time (:func:`precision.blockwise_loss`: the block, the bytes), or whole and why.
    Abstract: nothing is computed."""
    data, task, model = experiment or build_experiment(config)
    layout = layout_of(config)
    state = jax.eval_shape(lambda: build_train_state(config, model, data, layout)[0])
    size = config.data.batch_size * config.accum_steps
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   data.train_batch(0, size, config.seed))
    return blockwise_plan(state, batch, task=task, accum_steps=config.accum_steps, layout=layout).describe()
