"""The numerics doctor in training: a train step diagnosed, and the diagnosis a run
makes by itself when its loss scale gives up (``python -m train CONFIG --diagnose``
is :mod:`train.inspections.checkup`).

A train step is diagnosed as :func:`precision.diagnose` diagnoses a model: the
state's model under its policy, rules and op lists, on its float32 (master)
params and one training batch, through the task's loss at the state's loss
scale. The probed program is built apart from the train step, which compiles
to the same program whether or not the doctor runs; checkpoints are only read.
What it finds goes to ``WORKDIR/diagnosis.json`` (see docs/diagnose.md).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

import precision
from train.training.binding import doctor_subject
from train.data.model_inputs import call_arguments
from train.training.inference import cast_for_inference, full_precision_params
from train.training.state import TrainState

__all__ = ["DIAGNOSIS_FILE", "RunDoctor", "diagnose_inference", "diagnose_state", "summary_line", "write_diagnosis"]

DIAGNOSIS_FILE = "diagnosis.json"


def diagnose_state(state: TrainState, batch: dict, task: Any, *, verify: bool = True,
                   loss_scale: float | None = None) -> precision.Diagnosis:
    """The diagnosis of one train step of ``state`` on ``batch``: forward and backward
    of the model under its policy, rules and op lists, at the state's loss scale (or
    ``loss_scale``), on its float32 (master) params, where the state and batch are (a
    state on a mesh: on that mesh, each probed segment partitioned as the arrays are);
    with ``verify``, the changes that fix what it finds."""
    # On the device(s) the state is on: a state on a mesh is diagnosed on that mesh, as it is sharded.
    params = precision.full_precision_params(state.params, state.opt_state)
    batch = _arrays(batch)

    def loss_fn(outputs: Any) -> jax.Array:
        return task.loss(outputs, batch)[0]

    target, variables, kwargs = doctor_subject(state.model, {"params": params, **state.model_state}, True)
    scale = jax.device_get(state.loss_scale) if loss_scale is None else loss_scale
    args, inputs = call_arguments(batch["inputs"], state.inputs_as)  # one input, or several (model_inputs)
    return precision.diagnose(target, *args, variables=variables, loss_fn=loss_fn, loss_scale=scale,
                              verify=verify, **inputs, **kwargs)


def diagnose_inference(state: TrainState, batch: dict, dtype: Any, *, rules: Any = None,
                       verify: bool = True) -> precision.Diagnosis:
    """The diagnosis of serving ``state`` in ``dtype``: the model's forward pass in eval mode
    (no dropout, BatchNorm's running statistics) with its params stored and computed in
    ``dtype`` and outputs in float32, as :func:`train.cast_for_inference` serves it, under
    ``rules`` (default: the training model's, so norms stay float32), on ``batch``. It finds
    what overflows only when serving: weights rounded to ``dtype`` without their float32
    masters, activations of an eval-mode forward; with ``verify``, the rules that fix it."""
    served = cast_for_inference(state, dtype, rules).model
    params = full_precision_params(state)  # the float32 params served (cast by the doctor, as served)
    target, variables, kwargs = doctor_subject(served, {"params": params, **state.model_state}, False)
    args, inputs = call_arguments(_arrays(batch)["inputs"], state.inputs_as)
    return precision.diagnose(target, *args, variables=variables, verify=verify, **inputs, **kwargs)


def _arrays(batch: dict) -> dict:
    return jax.tree_util.tree_map(lambda v: v if isinstance(v, jax.Array) else np.asarray(v), batch)


def write_diagnosis(workdir: str, diagnosis: precision.Diagnosis, step: int, reason: str,
                    steps: list[dict] | None = None) -> str:
    """Writes ``diagnosis`` of the batch of ``step`` to ``WORKDIR/diagnosis.json``; returns its path."""
    path = os.path.join(workdir, DIAGNOSIS_FILE)
    record = {"step": step, "reason": reason, **diagnosis.to_dict()}
    if steps is not None:
        record["steps_diagnosed"] = steps
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, default=float)
    return path


def summary_line(diagnosis: precision.Diagnosis) -> str:
    """One line: where numerics first failed (or the worst problem) and the verified change."""
    first, problems = diagnosis.first_nonfinite, diagnosis.problems
    if first:
        where = f"{first['op']} in {first['path']} ({first['pass']}) first went non-finite"
    elif problems:
        p = problems[0]
        where = f"{p.kind} in {p.path}{' ' + p.op if p.op else ''} ({p.pass_}, {100 * p.share:.3g}%)"
    else:
        return "the doctor found no overflow, non-finite value, underflow or rounding on that batch"
    if diagnosis.recommendations:
        r = diagnosis.recommendations[0]
        fix = r.summary or r.command_line or r.change  # a rule: the one added, not the defaults it keeps
        return f"{where}; verified fix: {fix} ({r.before} -> {r.after})"
    if diagnosis.notes:
        return f"{where}; {diagnosis.notes[0]}"
    if not diagnosis.verified:
        return f"{where}; no change tried (verify=False)"
    return f"{where}; no change the doctor tried fixed it"


class RunDoctor:
    """The diagnoses a run makes by itself, each of one batch from the state it
    reached: once when a dynamic loss scale first sits at its minimum on a
    non-finite step, and when training stops on non-finite gradients. Each writes
    ``diagnosis.json`` and a ``{"kind": "diagnosis"}`` metrics record. The state is
    checkpointed before (the probed program is large: a doctor killed for memory
    must not cost the run its steps)."""

    def __init__(self, data: Any, task: Any, outputs: Any, tracker: Any, *, batch_size: int, seed: int):
        """``batch_size``: a step's examples (all its micro-batches); ``seed``: the run's, which
        with the step picks the batch (the data's ``train_batch``)."""
        self.data, self.task, self.outputs, self.tracker = data, task, outputs, tracker
        self.batch_size, self.seed = batch_size, seed
        self.done_at_min_scale = False

    def at_min_scale(self, state: TrainState) -> None:
        """After metrics are read: diagnoses (once) the first non-finite step at the minimum dynamic loss scale."""
        step = self.tracker.at_min_scale_step
        if step is None or self.done_at_min_scale:
            return
        self.done_at_min_scale = True
        with self.tracker.paused():
            self.outputs.checkpoint(state)
            self.outputs.checkpoints.wait()
        line = self.diagnose(state, step, "the dynamic loss scale reached its minimum on a non-finite step")
        print(f"warning: step {step} was non-finite at the minimum loss scale: {line}", file=self.outputs.out)

    def _scale_in_use(self, state: TrainState) -> float | None:
        """A dynamic scale: the one of the newest step with finite gradients, not the one the
        non-finite streak drove down to (at 1 every small gradient underflows). Others: the state's."""
        return self.tracker.scale_in_use if self.tracker.dynamic_scale else None

    def diagnose(self, state: TrainState, step: int, reason: str) -> str:
        """Diagnoses the batch of ``step`` from ``state``; the summary line (or why there is none)."""
        if jax.process_count() > 1:
            return "for where, run: python -m train CONFIG --diagnose (on one process)"
        try:
            with self.tracker.paused():
                batch = self.data.train_batch(step - 1, self.batch_size, self.seed)
                diagnosis = diagnose_state(state, batch, self.task, loss_scale=self._scale_in_use(state))
                path = write_diagnosis(self.outputs.workdir, diagnosis, step, reason)
        except Exception as e:  # noqa: BLE001 - a failed diagnosis must not cost the run its checkpoint
            return f"the doctor could not diagnose step {step}'s batch ({type(e).__name__}: {e})"
        line = summary_line(diagnosis)
        now = float(np.asarray(getattr(jax.device_get(state.loss_scale), "loss_scale", 1.0)))
        if diagnosis.loss_scale != now:
            line = f"at loss scale {diagnosis.loss_scale:g} (in use before it fell to {now:g}): {line}"
        self.tracker.record({"kind": "diagnosis", "step": step, "reason": reason, "summary": line, "file": path,
                             "first_nonfinite": diagnosis.first_nonfinite,
                             "problems": [p.to_dict() for p in diagnosis.problems],
                             "recommendations": [r.to_dict() for r in diagnosis.recommendations]})
        return f"{line}; details in {path}"
