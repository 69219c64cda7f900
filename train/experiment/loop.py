"""The training loop: an experiment config in, a trained, checkpointed, evaluated
model and a summary out. :func:`run` reads as the algorithm, one named phase a line:

    devices → experiment (data, task, model) → workdir → train state → restore
      → train: batches → train_step → metrics.jsonl / TensorBoard / progress → checkpoints, evaluations
      → finish: checkpoint → evaluate → half-precision inference → summary

Rerunning the same config resumes from the newest checkpoint in its workdir; a
larger ``steps`` continues a finished run. Batches are a pure function of
``(seed, step)``, so a resumed run sees the same data, and ends with the same
params, as an uninterrupted one.
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any, Callable, Iterator, TextIO

import jax
import jax.numpy as jnp
import numpy as np

import precision
from precision.policy import dtype_to_names
from train.experiment import compile_cache
from train.tracking import library_log
from train.experiment.builders import (build_data, build_experiment, build_model, build_optimizer,  # noqa: F401
                                       build_task, build_train_state, check_model_fits_data, experiment_from,
                                       train_state_from)
from train.experiment.names import resolve_names
from train.training.checkpoint import CheckpointError
from train.config import ConfigError, ExperimentConfig
from train.data import prefetch_to_device, train_batch_stack
from train.training.diagnose import RunDoctor
from train.experiment.mesh import describe_layout, layout_of, mesh_layout  # noqa: F401 - layout_of, mesh_layout re-exported
from train.parallel.distributed import Layout, MeshError, host_rows, initialize_distributed, to_host
from train.training.inference import inference_report
from train.tracking.metrics import OutputError, Progress
from train.experiment.outputs import Outputs, restore, save_last_good, save_on_interrupt
from train.weights.pretrained import describe_init
from train.training.state import TrainState, explain_model
from train.training.step import evaluate, make_eval_step, make_multi_step, make_train_step
from train.experiment.interrupts import interrupts_between_calls
from train.finetune import finetune_note
from train.config.tpu_policy import tpu_config_problem
from train.config.finetune import random_base_warning
from train.tracking.tracker import NonFiniteError, TrackedRun, Tracker, format_summary, model_label
from train.tracking.wandb_logger import check_wandb
from train.experiment.workdir import RESUMABLE_CHANGES, check_same_experiment, check_writable, resolved_config  # noqa: F401

__all__ = ["NonFiniteError", "build_experiment", "build_model", "build_optimizer", "check_experiment",
           "check_model_fits_data", "plan_calls", "run"]


def run(config: ExperimentConfig, *, out: TextIO | None = None,
        on_record: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Runs (or resumes) the experiment ``config`` describes and returns its summary.

    Writes ``WORKDIR/config.yaml``, ``metrics.jsonl``, ``tensorboard/``,
    ``checkpoints/`` and ``summary.json`` (process 0 of a multi-process run
    writes all but the checkpoints, which every process writes its shards of), and logs
    to Weights & Biases where ``tracker.wandb`` names a project (``WORKDIR/wandb/``).
    ``on_record`` sees every metrics record.

    Raises:
      ConfigError, DataError: before any compute, for a config that cannot run.
      NonFiniteError: gradients non-finite for ``max_nonfinite_steps`` consecutive
        steps (or every step of a shorter run) at the minimum loss scale, or the loss
        itself non-finite as long (the last good state is checkpointed, and the
        streak's first batch diagnosed: ``WORKDIR/diagnosis.json``, named in the message).
      CheckpointError: a checkpoint could not be written (earlier ones are kept)
        or none of the existing ones is intact.
      OutputError: the metrics or the summary could not be written.

    What the libraries log or warn while it trains goes to ``WORKDIR/train.log``.
    """
    out = sys.stdout if out is None else out
    check_writable(config.workdir, "workdir", create=False)  # before anything is computed; made by Outputs
    check_wandb(config)
    layout = _start_devices(config)
    if jax.process_index() != 0:
        out = io.StringIO()  # only process 0 reports
    names = resolve_names(config)  # every name the config gives, once: building reads what they stand for
    data, task, model = experiment_from(names, config)
    resolved = resolved_config(config, model, data, names.model)
    check_same_experiment(os.path.abspath(config.workdir), resolved)
    state, schedule = train_state_from(names, config, model, data, layout)
    outputs = Outputs(config, resolved, out, on_record, data)
    # libraries' logs and warnings: not the terminal; W&B (tracker.wandb) finished with the run's exit status
    with library_log.to_file(outputs.library_log), outputs.tracking():
        state, start = restore(outputs, state)
        tracker = _start_tracking(config, state, start, data, task, layout, outputs)
        evaluator = _Evaluator(config, data, task, layout, tracker)
        state = _train(config, state, start, data, task, layout, schedule, outputs, tracker, evaluator)
        return _finish(config, state, start, task, layout, outputs, tracker, evaluator)


def check_experiment(config: ExperimentConfig) -> str:
    """What :func:`run` checks before it computes anything, without training: the
    workdir (and a named compile cache) writable, the mesh fitting the devices, the
    data, task and model fitting each other, the train state buildable under the
    policy (``precision.strict`` included; both abstractly), and the workdir holding
    no other experiment's checkpoints. Returns a line describing the experiment (and a
    warning line where the config trains LoRA adapters on a fresh init).

    Raises:
      ConfigError, DataError: as :func:`run` would, before any compute.
    """
    workdir = check_writable(config.workdir, "workdir", create=False)
    check_wandb(config)
    if config.compile_cache not in (None, "auto"):
        check_writable(config.compile_cache, "compile_cache", create=False)
    layout = layout_of(config)
    names = resolve_names(config)
    data, task, model = experiment_from(names, config)
    check_same_experiment(workdir, resolved_config(config, model, data, names.model))
    # The train state's own checks (policy and rules on this model, strict coverage, reduce_dtype, the loss
    # scale against the optimizer), abstractly: nothing is allocated.
    jax.eval_shape(lambda: train_state_from(names, config, model, data, layout)[0])
    described = (f"{model_label(config.model.name)} on {data.describe()}; policy {config.precision.policy}; "
                 f"{config.steps} steps; {describe_layout(layout)}; workdir {workdir}")
    return "\n".join(line for line in (described, random_base_warning(config)) if line)


def plan_calls(start: int, end: int, steps_per_call: int, every: tuple[int, ...] = ()) -> Iterator[tuple[int, int]]:
    """The device calls that train from step ``start`` to ``end``: ``(first, count)``
    pairs, a call training steps ``first + 1 .. first + count`` on batches ``first ..
    first + count - 1``.

    The first call is one step (its time includes compilation); the others hold
    up to ``steps_per_call`` steps and end on every multiple of each nonzero
    interval in ``every`` (evaluations, checkpoints), where the loop needs the state.
    """
    first = start
    while first < end:
        stop = min(end, first + (1 if first == start else steps_per_call))
        for interval in every:
            if interval:
                stop = min(stop, (first // interval + 1) * interval)
        yield first, stop - first
        first = stop


# ----------------------------------------------------------------------------- phases


def _start_devices(config: ExperimentConfig) -> Layout:
    """The compilation cache, the processes of a multi-process run, and the device mesh."""
    start_compile_cache(config.compile_cache)
    try:
        initialize_distributed(**config.distributed.model_dump())
    except MeshError as e:
        raise ConfigError(str(e)) from None
    return layout_of(config)


def start_compile_cache(setting: str | None) -> None:
    """The persistent compilation cache ``compile_cache`` names; ``auto`` goes without
    one where its default directory cannot be written, a named one must be writable."""
    if setting is None:
        return
    directory = compile_cache.default_dir() if setting == "auto" else setting
    if directory is None:
        return
    try:
        compile_cache.enable(check_writable(str(directory), "compile_cache"))
    except ConfigError:
        if setting != "auto":
            raise


def _start_tracking(config: ExperimentConfig, state: TrainState, start: int, data: Any, task: Any, layout: Layout,
                    outputs: Outputs) -> Tracker:
    """The progress bar and the host-side bookkeeping; announces the run."""
    notes = _fp8_coverage(config, state, data)
    header = [*_data_notes(data), *notes, *tpu_notes(config), state_note(state, config.accum_steps)]
    header += [line for line in (finetune_note(state.params, state.frozen), random_base_warning(config)) if line]
    run = TrackedRun(config.model.name, config.precision.policy, config.steps, config.log_every,
                     config.max_nonfinite_steps, config.data.batch_size * config.accum_steps)
    primary = jax.process_index() == 0
    progress = Progress(config.steps, start, primary and config.progress and start < config.steps)
    tracker = Tracker(run, state, data, task, outputs.writer, progress, outputs.on_record, notes)
    print(f"{model_label(config.model.name)} on {data.describe()}; policy {state.policy} ({config.precision.policy}), "
          f"loss scale {type(state.loss_scale).__name__}; steps {start} -> {config.steps}"
          f"{describe_init(config.model.init_from, resuming=start > 0)}; "
          f"{describe_layout(layout)}; workdir {outputs.workdir}", file=outputs.out)
    for note in header:
        print(note, file=outputs.out)
    outputs.report_precision(state, data.sample_input(config.data.batch_size), header)
    return tracker


def tpu_notes(config: ExperimentConfig, backend: str | None = None) -> list[str]:
    """On a TPU (``backend``: JAX's default), a policy or rule it does not compute in natively
    (float16, emulated; FP8), said in one line; the run goes on."""
    if (backend or jax.default_backend()) != "tpu":
        return []
    problem = tpu_config_problem(config)
    return [f"note: {problem}"] if problem else []


def state_note(state: TrainState, accum_steps: int = 1) -> str:
    """What the train state stores per parameter, by part, and the gradient accumulation
    buffer a step holds when it accumulates (docs/stored-state.md)."""
    accum = accumulation_dtype(state.policy, accum_steps)
    b = precision.state_bytes(state.params, state.opt_state, accum)
    note = (f"train state: {b['total']:.1f} bytes/param (params {b['params']:.1f}, masters {b['masters']:.1f}, "
            f"optimizer {b['optimizer']:.1f}")
    if accum is not None:
        other = np.dtype(jnp.bfloat16) if accum == np.dtype(np.float32) else np.dtype(np.float32)
        note += (f", gradient accumulation {b['accumulation']:.1f} during a step; "
                 f"accum={dtype_to_names[other][0]} would take {float(other.itemsize):.1f}")
    return note + f"); policy {state.policy}"


def accumulation_dtype(policy: precision.Policy, accum_steps: int) -> np.dtype | None:
    """The dtype a step sums micro-batch gradients in (None: it does not accumulate)."""
    return np.dtype(policy.accum_dtype or np.float32) if accum_steps > 1 else None


def _data_notes(data: Any) -> list[str]:
    """What looks wrong in the data without being an error: one number per example."""
    if data.input_shape == () and data.task == "classification":
        return [f"note: {data.name}'s inputs are one number per example (shape ()); if each example has "
                f"features, return inputs with one row per example, e.g. shape (examples, features)"]
    return []


def _fp8_coverage(config: ExperimentConfig, state: TrainState, data: Any) -> list[str]:
    """Under an FP8 (int8) policy, the share of matmul FLOPs FP8 (int8) covers (a run that
    computes nothing in it says so, instead of training as bf16 without a word)."""
    if not (state.policy.fp8 or state.policy.int8):
        return []
    explanation = explain_model(state.model, data.sample_input(config.data.batch_size), train=True, backward=True,
                                inputs_as=state.inputs_as)
    return [explanation.fp8_coverage if state.policy.fp8 else explanation.int8_coverage]


class _Evaluator:
    """Evaluation on the eval split, timed apart from training and recorded."""

    def __init__(self, config: ExperimentConfig, data: Any, task: Any, layout: Layout, tracker: Tracker):
        self.config, self.data, self.task, self.layout, self.tracker = config, data, task, layout, tracker
        self.step = make_eval_step(layout=layout, task=task)

    def batches(self) -> Iterator[dict]:
        """This process's rows of each eval batch, on their devices."""
        size = self.config.data.eval_batch_size
        rows = host_rows(size)
        split = self.data.eval_batches(size, self.config.data.eval_batches)
        local = (jax.tree_util.tree_map(lambda v: v[rows], b) for b in split)
        return prefetch_to_device(local, self.config.data.prefetch, lambda b: self.layout.global_batch(b, size))

    def __call__(self, state: TrainState) -> dict:
        with self.tracker.paused():
            metrics = evaluate(self.step, state, self.batches(), self.task.name)
            self.tracker.record({"kind": "eval", "step": int(to_host(state.step)), **metrics})
        return metrics


def _train(config: ExperimentConfig, state: TrainState, start: int, data: Any, task: Any, layout: Layout,
           schedule: Any, outputs: Outputs, tracker: Tracker, evaluate_now: _Evaluator) -> TrainState:
    """Trains from step ``start`` to ``config.steps``; an interrupt or a non-finite
    stop checkpoints the state first (skipped steps never change params)."""
    train_step = make_train_step(accum_steps=config.accum_steps, learning_rate_fn=schedule, layout=layout,
                                 task=task)
    per_call = _steps_per_call(config, start)
    step_fn = make_multi_step(train_step, per_call) if per_call > 1 else (lambda s, b, _: train_step(s, b))
    calls = plan_calls(start, config.steps, per_call, (config.eval_every, config.checkpoint_every))
    batch_size = config.data.batch_size * config.accum_steps
    batches = prefetch_to_device(
        _train_inputs(data, calls, per_call, batch_size, config.seed),
        config.data.prefetch, lambda b: layout.global_batch(b, batch_size, stacked=per_call > 1))
    holder = [state]  # the newest state, also when a call is interrupted
    doctor = RunDoctor(data, task, outputs, tracker, batch_size=batch_size, seed=config.seed)
    try:
        with interrupts_between_calls() as interrupted:
            _train_calls(config, holder, start, step_fn, batches, outputs, tracker, evaluate_now, doctor,
                         interrupted)
    except KeyboardInterrupt:
        saved = save_on_interrupt(outputs, holder[0], tracker)
        outputs.writer.close()
        raise KeyboardInterrupt(saved) from None
    except NonFiniteError as e:
        step = int(to_host(holder[0].step))  # metrics are read in batches: the loop may be ahead of the streak
        # Skipped steps leave params unchanged: the state now is the last good one, at the streak's start too.
        saved = save_last_good(outputs, holder[0], tracker)  # on disk first: the doctor compiles a large program
        found = doctor.diagnose(holder[0], e.first_step, "training stopped on non-finite gradients")
        outputs.writer.close()
        raise NonFiniteError(f"training stopped at step {step}: {e} The doctor, on step {e.first_step}'s batch: "
                             f"{found}.{saved}", e.first_step) from None
    except (CheckpointError, OutputError):
        outputs.writer.close()
        raise
    finally:
        tracker.progress.close()
    return holder[0]


def _train_calls(config: ExperimentConfig, holder: list, start: int, step_fn: Callable, batches: Iterator,
                 outputs: Outputs, tracker: Tracker, evaluate_now: _Evaluator, doctor: RunDoctor,
                 interrupted: Callable[[], None]) -> None:
    """The device calls of :func:`plan_calls`, their metrics read once per log
    interval (the device always has a call queued), checkpoints and evaluations
    on their steps. ``holder[0]`` is the newest state; ``interrupted()`` raises a
    Ctrl-C received since the last call."""
    per_call = _steps_per_call(config, start)
    pending: list[tuple[int, int | None, Any]] = []  # dispatched calls whose metrics are still on the device
    observed = start
    for first, n in plan_calls(start, config.steps, per_call, (config.eval_every, config.checkpoint_every)):
        interrupted()
        holder[0], metrics = step_fn(holder[0], next(batches), n)
        step = first + n
        tracker.progress.update(n)
        pending.append((first + 1, None if per_call == 1 else n, metrics))
        due_eval = config.eval_every and step % config.eval_every == 0 and step < config.steps
        due_checkpoint = config.checkpoint_every and step % config.checkpoint_every == 0
        if first == start or due_eval or due_checkpoint or step == config.steps:
            tracker.observe(pending)  # all of them (the first: its time includes compilation)
            pending, observed = [], step
        elif first // config.log_every > observed // config.log_every:
            # The calls through the last logged step, while this one computes.
            tracker.observe(pending[:-1])
            pending, observed = pending[-1:], first
        doctor.at_min_scale(holder[0])
        if due_checkpoint:
            with tracker.paused():
                outputs.checkpoint(holder[0])
        if due_eval:
            evaluate_now(holder[0])


def _finish(config: ExperimentConfig, state: TrainState, start: int, task: Any, layout: Layout, outputs: Outputs,
            tracker: Tracker, evaluate_now: _Evaluator) -> dict[str, Any]:
    """The last checkpoint, the final evaluation, the trained model served in half
    precision, and the summary (printed and in ``summary.json``)."""
    with tracker.paused():
        outputs.checkpoint(state)
    outputs.checkpoints.close()
    eval_metrics = evaluate_now(state)
    report = {}
    if config.inference_dtypes:
        report = inference_report(state, evaluate_now.batches, task, config.inference_dtypes, layout=layout)
        for dtype, metrics in report.items():
            tracker.record({"kind": "inference", "step": int(to_host(state.step)), "dtype": dtype, **metrics})
    outputs.writer.close()
    summary = tracker.summary(state, eval_metrics, report, start, outputs.workdir)
    if jax.process_index() == 0:
        path = os.path.join(outputs.workdir, "summary.json")
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
        except OSError as e:
            raise OutputError(f"could not write {path}: {e.strerror or e}; the trained state is checkpointed in "
                              f"{outputs.checkpoints.directory}") from None
    outputs.log_summary(summary)
    print(format_summary(summary), file=outputs.out)
    return summary


# ----------------------------------------------------------------------------- helpers


def _steps_per_call(config: ExperimentConfig, start: int) -> int:
    """``steps_per_call``, at most the steps this run trains (a call's batches are stacked)."""
    return max(1, min(config.steps_per_call, config.steps - start))


def _train_inputs(data: Any, calls: Iterator[tuple[int, int]], per_call: int, batch_size: int, seed: int
                  ) -> Iterator[dict]:
    """This process's rows of each call's batch (``per_call == 1``) or stack of batches."""
    rows = host_rows(batch_size)
    for first, count in calls:
        yield (data.train_batch(first, batch_size, seed, rows) if per_call == 1
               else train_batch_stack(data, first, count, per_call, batch_size, seed, rows))
