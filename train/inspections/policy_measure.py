"""One candidate policy of ``python -m train CONFIG --pick-policy``, measured on this machine.

For a candidate (a policy and its precision settings) :func:`measure_candidate`
builds the experiment's train state under it (the config's seed: the same
float32 init for every candidate), and measures:

- fidelity: N train steps on the same batches as every candidate, then the loss
  on the eval batches (compared with float32's by :func:`precision.pick_policy`),
  and the steps the loss scale skipped;
- cost: each step's wall time after the first, the train state's bytes, and the
  compiled step's memory from XLA's plan against the device's memory;
- numerics: where the steps show a symptom (a skipped step, a non-finite loss, a
  loss off float32's by more than the tolerance), the doctor
  (:func:`train.diagnose_state`, changes verified) on the first batches from the
  initial state: the candidate is measured again under its first verified change
  (whose overrides become the candidate's settings), or dropped with the reason
  for an overflow or non-finite value no change fixes. Steps without a symptom
  need no doctor: whatever it could find on those batches did not reach them.

The step is compiled once (ahead of time) and the same executable is timed;
the persistent compile cache serves a rerun.
"""


from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import yaml

import precision
from train.experiment.builders import build_train_state
from train.experiment.fits import device_memory_bytes
from train.config import ConfigError, ExperimentConfig, from_dict, to_dict
from train.data import DataError
from train.training.diagnose import diagnose_state, summary_line
from train.references import one_line
from train.training.state import TrainState, explain_model
from train.training.step import evaluate, make_eval_step, make_train_step

__all__ = ["DOCTOR_BATCHES", "Experiment", "doctor_batch", "measure_candidate", "memory_limit", "with_precision"]

#: Batches the doctor examines per candidate.
DOCTOR_BATCHES = 2
#: Problems that drop a candidate when no change fixes them (rounding and underflow leave it to the loss).
SEVERE = ("overflow", "nonfinite")


class Experiment(NamedTuple):
    """What every candidate shares: the config, data, task, model, layout and the batches (on the devices)."""

    config: ExperimentConfig
    data: Any
    task: Any
    model: Any
    layout: Any
    batches: list  # train batches 0 .. steps - 1
    eval_batches: list


def with_precision(config: ExperimentConfig, settings: dict[str, Any]) -> ExperimentConfig:
    """``config`` with its ``precision`` section's keys in ``settings`` changed (validated: a
    bad value is a :class:`ConfigError` naming ``precision.<key>``)."""
    raw = to_dict(config)
    raw["precision"] = {**raw["precision"], **settings}
    return from_dict(raw)


def memory_limit() -> int | None:
    """One device's memory: an accelerator's as it reports it, else this machine's RAM."""
    return device_memory_bytes(jax.local_devices()[:1])


def measure_candidate(experiment: Experiment, candidate: precision.Candidate, reference_loss: float | None = None,
                      tolerance: float | None = None) -> precision.Measurement:
    """The candidate measured (see the module's docstring): N steps, and the doctor where
    they show a symptom (a skipped step, a non-finite loss, a loss off ``reference_loss``
    by more than ``tolerance``). A candidate that cannot be built, compiled or run is a
    measurement with its ``error``, in one line."""
    base = {"policy": candidate.policy, **candidate.settings}
    try:
        config = with_precision(experiment.config, base)
        state, schedule = build_train_state(config, experiment.model, experiment.data, experiment.layout)
        if state.policy.fp8 or state.policy.int8:
            coverage = explain_model(state.model, experiment.data.sample_input(config.data.batch_size), train=True,
                                     backward=True, inputs_as=state.inputs_as)
            name, share, why = (("FP8", coverage.fp8_share, coverage.fp8_coverage) if state.policy.fp8 else
                                ("int8", coverage.int8_share, coverage.int8_coverage))
            if share == 0:
                return _measured(candidate, base, numerics="dropped",
                                 numerics_note=f"no matmul would run in {name} ({why})")
        measured = _run(experiment, config, state, schedule, candidate, base)
        symptom = _symptom(measured, reference_loss, tolerance)
        if measured.is_reference:
            return dataclasses.replace(measured, numerics_note="float32, the reference")
        if symptom is None:
            return dataclasses.replace(measured, numerics_note=f"no skipped step or non-finite loss in "
                                                               f"{measured.steps} steps")
        return _treated(experiment, config, candidate, base, measured, symptom)
    except (ConfigError, DataError, precision.PolicyError) as e:
        return _measured(candidate, base, error=str(e))
    except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or run (memory, backend) is measured so
        return _measured(candidate, base, error=one_line(e))


def _measured(candidate: precision.Candidate, settings: dict, **fields: Any) -> precision.Measurement:
    settings = dict(settings)
    return precision.Measurement(candidate.name, str(settings.pop("policy")), settings, **fields)


def _symptom(m: precision.Measurement, reference_loss: float | None, tolerance: float | None) -> str | None:
    """What in ``m``'s steps calls for the doctor (None: nothing)."""
    if m.loss is None or not np.isfinite(m.loss):
        return f"the loss after {m.steps} steps is {m.loss}"
    if m.skipped_steps:
        return f"{m.skipped_steps} of {m.steps} steps skipped (non-finite gradients)"
    if reference_loss and tolerance and abs(m.loss - reference_loss) > tolerance * abs(reference_loss):
        return f"the loss is {100 * abs(m.loss - reference_loss) / abs(reference_loss):.2f}% from float32's"
    return None


def doctor_batch(batches: list) -> dict:
    """The first :data:`DOCTOR_BATCHES` batches as one: the doctor's probed program compiled once for all."""
    first = batches[:DOCTOR_BATCHES]
    return jax.tree_util.tree_map(lambda *xs: jax.numpy.concatenate(xs), *first) if len(first) > 1 else first[0]


def _treated(experiment: Experiment, config: ExperimentConfig, candidate: precision.Candidate, base: dict,
             measured: precision.Measurement, symptom: str) -> precision.Measurement:
    """The doctor, with its changes verified, on the first batches from the initial state; the
    candidate measured again under the first verified change (``fixed``), or kept with the
    doctor's finding (``warning``), or ``dropped`` for an overflow or non-finite value no change fixes."""
    state, _ = build_train_state(config, experiment.model, experiment.data, experiment.layout)  # the run took it
    count = min(DOCTOR_BATCHES, len(experiment.batches))
    diagnosis = diagnose_state(state, doctor_batch(experiment.batches), experiment.task)
    if diagnosis.healthy:
        return dataclasses.replace(measured, numerics_note=f"{symptom}; the doctor found no overflow, underflow or "
                                                           f"rounding problem on the first {count} batches")
    problem = summary_line(diagnosis)
    severe = diagnosis.first_nonfinite is not None or any(p.kind in SEVERE for p in diagnosis.problems)
    change = next((r for r in diagnosis.recommendations if r.overrides), None)
    if change is None:
        return dataclasses.replace(measured, numerics="dropped" if severe else "warning",
                                   numerics_note=f"{symptom}; {problem}")
    settings = {}
    for item in change.overrides:
        key, _, value = item.partition("=")
        settings[key.removeprefix("precision.")] = yaml.safe_load(value)
    fixed_config = with_precision(config, settings)
    state, schedule = build_train_state(fixed_config, experiment.model, experiment.data, experiment.layout)
    fixed = _run(experiment, fixed_config, state, schedule, candidate, {**base, **settings})
    return dataclasses.replace(fixed, numerics="fixed", numerics_note=f"{symptom}; {problem}")


def _run(experiment: Experiment, config: ExperimentConfig, state: TrainState, schedule: Any,
         candidate: precision.Candidate, settings: dict) -> precision.Measurement:
    """N steps of the compiled step, each timed; the eval loss after them; XLA's memory plan."""
    step = make_train_step(accum_steps=config.accum_steps, learning_rate_fn=schedule, layout=experiment.layout,
                           task=experiment.task)
    state_bytes = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(state) if hasattr(x, "nbytes"))
    compiled = step.lower(state, experiment.batches[0]).compile()
    memory = compiled.memory_analysis()
    peak = None if memory is None else int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                           + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
    seconds, metrics = [], None
    for batch in experiment.batches:
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        seconds.append(time.perf_counter() - start)
    eval_step = make_eval_step(layout=experiment.layout, task=experiment.task)
    loss = evaluate(eval_step, state, experiment.eval_batches, experiment.task.name)["loss"]
    return _measured(candidate, settings, loss=loss,
                     steps=len(experiment.batches), skipped_steps=int(np.asarray(metrics["skipped_steps"])),
                     step_seconds=tuple(seconds[1:]), state_bytes=state_bytes, peak_bytes=peak,
                     memory_limit=memory_limit())
