"""The training loop: an experiment config in, a trained, checkpointed, evaluated
model and a summary out.

    data → train_step → metrics.jsonl / TensorBoard / progress → checkpoints → eval

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
import yaml

from train import compile_cache, config as config_lib
from train.checkpoint import CheckpointError, Checkpointer
from train.config import ConfigError, ExperimentConfig
from train.builders import (build_data, build_model, build_optimizer, build_task, build_train_state,  # noqa: F401
                            check_model_fits_data, model_options)
from train.data import prefetch_to_device, train_batch_stack
from train.distributed import Layout, MeshError, host_rows, initialize_distributed, make_mesh, to_host
from train.inference import inference_report
from train.metrics import MetricsWriter, NullWriter, Progress
from train.tracker import NonFiniteError, Tracker, format_summary, model_label
from train.models import MODELS
from train.state import TrainState
from train.step import evaluate, make_eval_step, make_multi_step, make_train_step

__all__ = ["NonFiniteError", "build_experiment", "build_model", "build_optimizer", "check_model_fits_data",
           "plan_calls", "run"]

#: Config keys that may change between a run and its resumption.
RESUMABLE_CHANGES = ("steps", "steps_per_call", "workdir", "compile_cache", "log_every", "eval_every",
                     "checkpoint_every", "keep_checkpoints",
                     "max_nonfinite_steps", "inference_dtypes", "progress", "precision.strict", "data.eval_batch_size",
                     "data.eval_batches", "data.prefetch", "data.path", "mesh.data", "mesh.fsdp",
                     "mesh.fsdp_min_size", "distributed.coordinator_address", "distributed.num_processes",
                     "distributed.process_id", "distributed.cluster_detect", "distributed.timeout_seconds")


def build_experiment(config: ExperimentConfig) -> tuple[Any, Any, Any]:
    """The data, task and (unwrapped) model ``config`` names, checked to fit
    each other before any compute (:class:`ConfigError` / ``DataError`` if not)."""
    data = build_data(config.data, config.seed)
    task = build_task(config.task, data)
    model = build_model(config.model, data, config.seed)
    check_model_fits_data(model, data, config.model.name, task)
    return data, task, model


def run(config: ExperimentConfig, *, out: TextIO | None = None,
        on_record: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Runs (or resumes) the experiment ``config`` describes and returns its summary.

    Writes ``WORKDIR/config.yaml``, ``metrics.jsonl``, ``tensorboard/``,
    ``checkpoints/`` and ``summary.json`` (process 0 of a multi-process run
    writes all but the checkpoints, which every process writes its shards of).
    ``on_record`` sees every metrics record.

    Raises:
      ConfigError, DataError: before any compute, for a config that cannot run.
      NonFiniteError: gradients non-finite for ``max_nonfinite_steps`` consecutive
        steps at the minimum loss scale (the last good state is checkpointed).
      CheckpointError: a checkpoint could not be written (earlier ones are kept)
        or none of the existing ones is intact.
    """
    out = sys.stdout if out is None else out
    if config.compile_cache is not None:
        compile_cache.enable(None if config.compile_cache == "auto" else config.compile_cache)
    try:
        initialize_distributed(**config.distributed.model_dump())
        layout = Layout(make_mesh(config.mesh.data, config.mesh.fsdp), config.mesh.fsdp_min_size)
        layout.check_batch_size(config.data.batch_size)
        layout.check_batch_size(config.data.eval_batch_size, "data.eval_batch_size")
    except MeshError as e:
        raise ConfigError(str(e)) from None
    primary = jax.process_index() == 0
    if not primary:
        out = io.StringIO()  # only process 0 reports
    data, task, model = build_experiment(config)
    resolved = config_lib.to_dict(config)
    if config.model.name in MODELS:
        resolved["model"].update({k: list(v) if isinstance(v, tuple) else v for k, v in
                                  ((f, getattr(model, f)) for f in config_lib.model_fields(config.model.name))})
    else:
        resolved["model"].update(model_options(config.model, data))
    workdir = os.path.abspath(config.workdir)
    _check_same_experiment(workdir, resolved)

    state, schedule = build_train_state(config, model, data, layout)
    os.makedirs(workdir, exist_ok=True)
    if primary:
        with open(os.path.join(workdir, "config.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(resolved, f, sort_keys=False)

    writer = MetricsWriter(workdir) if primary else NullWriter()
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"), config.keep_checkpoints)

    def corrupt(step: int, reason: str) -> None:
        print(f"warning: {reason}; falling back to the previous checkpoint", file=out)
        record = {"kind": "checkpoint_corrupt", "step": step, "message": reason}
        writer.write(record)
        if on_record is not None:
            on_record(record)

    start = 0
    try:
        restored = checkpoints.restore_latest_good(state, on_corrupt=corrupt)
    except CheckpointError:
        checkpoints.close()
        writer.close()
        raise
    if restored is not None:
        state, meta = restored
        start = int(to_host(state.step))
        if meta.get("data_position") != start:
            raise ConfigError(f"checkpoint at step {start} in {checkpoints.directory} records data position "
                              f"{meta.get('data_position')}, expected {start}: it was not written by this run")
        print(f"resuming from the checkpoint at step {start} in {checkpoints.directory}", file=out)

    progress = Progress(config.steps, start, primary and config.progress and start < config.steps)
    tracker = Tracker(config, state, data, task, writer, progress, on_record)
    print(f"{model_label(config.model.name)} on {data.describe()}; policy {state.policy} ({config.precision.policy}), "
          f"loss scale {type(state.loss_scale).__name__}; steps {start} -> {config.steps}; "
          f"{_describe_layout(layout)}; workdir {workdir}", file=out)
    train_step = make_train_step(accum_steps=config.accum_steps, learning_rate_fn=schedule, layout=layout,
                                 task=task)
    eval_step = make_eval_step(layout=layout, task=task)
    eval_size = config.data.eval_batch_size

    def eval_batches():
        rows = host_rows(eval_size)
        local = ({k: v[rows] for k, v in b.items()}
                 for b in data.eval_batches(eval_size, config.data.eval_batches))
        return prefetch_to_device(local, config.data.prefetch, lambda b: layout.global_batch(b, eval_size))

    def evaluate_now(state):
        with tracker.paused():
            metrics = evaluate(eval_step, state, eval_batches(), task.name)
            tracker.record({"kind": "eval", "step": int(to_host(state.step)), **metrics})
        return metrics

    def checkpoint_now(state):
        with tracker.paused():
            checkpoints.save(state, {"data_position": int(to_host(state.step)), "config": resolved})

    batch_size, per_call = config.data.batch_size * config.accum_steps, config.steps_per_call
    every = (config.eval_every, config.checkpoint_every)
    batches = prefetch_to_device(
        _train_inputs(data, plan_calls(start, config.steps, per_call, every), per_call, batch_size, config.seed),
        config.data.prefetch, lambda b: layout.global_batch(b, batch_size, stacked=per_call > 1))
    step_fn = make_multi_step(train_step, per_call) if per_call > 1 else (lambda s, b, _: train_step(s, b))
    try:
        pending: list[tuple[int, int | None, Any]] = []  # dispatched calls whose metrics are still on the device
        observed = start
        for first, n in plan_calls(start, config.steps, per_call, every):
            state, metrics = step_fn(state, next(batches), n)
            step = first + n
            progress.update(n)
            pending.append((first + 1, None if per_call == 1 else n, metrics))
            due_eval = config.eval_every and step % config.eval_every == 0 and step < config.steps
            due_checkpoint = config.checkpoint_every and step % config.checkpoint_every == 0
            if first == start or due_eval or due_checkpoint or step == config.steps:
                tracker.observe(pending)  # all of them (the first: its time includes compilation)
                pending, observed = [], step
            elif first // config.log_every > observed // config.log_every:
                # The calls through the last logged step, while this one computes: one read per log
                # interval, and the device always has a call queued.
                tracker.observe(pending[:-1])
                pending, observed = pending[-1:], first
            if due_checkpoint:
                checkpoint_now(state)
            if due_eval:
                evaluate_now(state)
    except KeyboardInterrupt:
        saved = _save_on_interrupt(checkpoints, state, resolved, tracker)
        writer.close()
        raise KeyboardInterrupt(saved) from None
    except NonFiniteError as e:
        # Skipped steps leave params and optimizer state untouched, so the
        # current state holds the params of the last finite step.
        try:
            checkpoint_now(state)
            checkpoints.close()
            note = (f" Skipped steps leave params unchanged: the last good state is checkpointed at step "
                    f"{int(to_host(state.step))} in {checkpoints.directory}.")
        except CheckpointError as save_error:
            note = f" Saving the last good state failed: {save_error}"
        writer.close()
        raise NonFiniteError(str(e) + note) from None
    except CheckpointError:
        writer.close()
        raise
    finally:
        progress.close()
    checkpoint_now(state)
    checkpoints.close()
    eval_metrics = evaluate_now(state)
    report = {}
    if config.inference_dtypes:
        report = inference_report(state, eval_batches, task, config.inference_dtypes, layout=layout)
        for dtype, metrics in report.items():
            tracker.record({"kind": "inference", "step": int(to_host(state.step)), "dtype": dtype, **metrics})
    writer.close()
    summary = tracker.summary(state, eval_metrics, report, start, workdir)
    if primary:
        with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    print(format_summary(summary), file=out)
    return summary


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


def _train_inputs(data: Any, calls: Iterator[tuple[int, int]], per_call: int, batch_size: int, seed: int
                  ) -> Iterator[dict]:
    """This process's rows of each call's batch (``per_call == 1``) or stack of batches."""
    rows = host_rows(batch_size)
    for first, count in calls:
        yield (data.train_batch(first, batch_size, seed, rows) if per_call == 1
               else train_batch_stack(data, first, count, per_call, batch_size, seed, rows))


def _describe_layout(layout: Layout) -> str:
    shape = dict(layout.mesh.shape)
    devices = layout.mesh.devices.size
    processes = jax.process_count()
    where = f"{devices} {jax.devices()[0].platform} device{'s' if devices > 1 else ''}"
    if processes > 1:
        where += f" in {processes} processes"
    return f"{where}, mesh data={shape['data']} fsdp={shape['fsdp']}"


def _check_same_experiment(workdir: str, resolved: dict) -> None:
    path = os.path.join(workdir, "config.yaml")
    if not os.path.exists(os.path.join(workdir, "checkpoints")) or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        previous = yaml.safe_load(f) or {}
    defaults = config_lib.to_dict(ExperimentConfig())  # keys added since the run began hold their defaults
    name = resolved["model"]["name"]
    if name in MODELS:  # and so do fields a built-in model gained
        defaults["model"] = {"name": name, **{k: list(d) if isinstance(d, tuple) else d
                                             for k, (_, d) in config_lib.model_fields(name).items()}}
    changed = [key for key in _flat_keys(resolved) | _flat_keys(previous)
               if key not in RESUMABLE_CHANGES and _get(resolved, key) != _get(previous, key)
               and not (_get(previous, key) is None and _get(resolved, key) == _get(defaults, key))]
    if changed:
        details = "; ".join(f"{k}: {_get(previous, k)!r} -> {_get(resolved, k)!r}" for k in sorted(changed))
        raise ConfigError(f"workdir {workdir} holds checkpoints of a different experiment ({details}). "
                          f"Resuming would mix them; set workdir=NEW_DIR, or delete {workdir} to start over.")


def _flat_keys(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in tree.items():
        if isinstance(v, dict):  # a section (no field's value is a mapping)
            keys |= _flat_keys(v, f"{prefix}{k}.")
        else:
            keys.add(prefix + k)
    return keys


def _get(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _save_on_interrupt(checkpoints: Checkpointer, state: TrainState, resolved: dict, tracker: Tracker) -> str:
    try:
        step = checkpoints.save(state, {"data_position": int(to_host(state.step)), "config": resolved})
        checkpoints.close()
        message = f"interrupted; saved a checkpoint at step {step}"
    except Exception as e:  # a buffer donated to a step that never returned cannot be saved
        checkpoints.close()
        message = (f"interrupted; the current state could not be saved ({type(e).__name__}); the newest "
                   f"checkpoint is at step {checkpoints.latest_step()}")
    tracker.record({"kind": "interrupted", "step": tracker.last_step, "message": message})
    return f"{message} in {checkpoints.directory}; rerun the same command to resume"
