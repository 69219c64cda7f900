"""The training loop: an experiment config in, a trained, checkpointed, evaluated
model and a summary out.

    data → train_step → metrics.jsonl / TensorBoard / progress → checkpoints → eval

Rerunning the same config resumes from the newest checkpoint in its workdir; a
larger ``steps`` continues a finished run. Batches are a pure function of
``(seed, step)``, so a resumed run sees the same data, and ends with the same
params, as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, TextIO

import jax
import numpy as np
import optax
import yaml

import precision
from train import config as config_lib
from train.checkpoint import Checkpointer
from train.config import ConfigError, ExperimentConfig
from train.data import load_dataset, prefetch_to_device, train_batches
from train.inference import inference_report
from train.metrics import MetricsWriter, Progress
from train.models import MODELS
from train.state import TrainState, create_train_state
from train.step import evaluate, make_eval_step, make_train_step

__all__ = ["NonFiniteError", "build_model", "build_optimizer", "run"]

#: Config keys that may change between a run and its resumption.
RESUMABLE_CHANGES = ("steps", "workdir", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "max_nonfinite_steps", "inference_dtypes", "progress", "data.eval_batch_size",
                     "data.eval_batches", "data.prefetch", "data.path")


class NonFiniteError(RuntimeError):
    """Gradients stayed non-finite at the minimum loss scale; training cannot recover by itself."""


def build_model(model_config: config_lib.ModelConfig, data: Any) -> Any:
    """The Linen model a config names; class counts, vocabulary and context length
    default to the data's."""
    cls = MODELS[model_config.name]
    options = dict(model_config.options)
    fields = config_lib.model_fields(model_config.name)
    if "num_classes" in fields:
        options.setdefault("num_classes", data.num_classes)
    if "vocab_size" in fields:
        options.setdefault("vocab_size", data.num_classes)
    if "block_size" in fields:
        options.setdefault("block_size", data.input_shape[0])
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    return cls(**options)


def build_optimizer(opt: config_lib.OptimizerConfig, steps: int
                    ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax optimizer and learning-rate schedule an optimizer config describes."""
    warmup = min(opt.warmup_steps, steps)
    if opt.schedule == "constant":
        after = optax.constant_schedule(opt.lr)
    elif opt.schedule == "cosine":
        after = optax.cosine_decay_schedule(opt.lr, max(steps - warmup, 1), alpha=opt.min_lr / opt.lr)
    else:
        after = optax.linear_schedule(opt.lr, opt.min_lr, max(steps - warmup, 1))
    schedule = (optax.join_schedules([optax.linear_schedule(0.0, opt.lr, warmup), after], [warmup])
                if warmup else after)
    if opt.name == "adam":
        tx = optax.adam(schedule, opt.b1, opt.b2, opt.eps)
    elif opt.name == "adamw":
        tx = optax.adamw(schedule, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay)
    elif opt.name == "lion":
        tx = optax.lion(schedule, opt.b1, opt.b2, weight_decay=opt.weight_decay)
    else:
        tx = optax.sgd(schedule, opt.momentum or None, opt.nesterov)
        if opt.weight_decay:
            tx = optax.chain(optax.add_decayed_weights(opt.weight_decay), tx)
    return tx, schedule


def run(config: ExperimentConfig, *, out: TextIO | None = None,
        on_record: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Runs (or resumes) the experiment ``config`` describes and returns its summary.

    Writes ``WORKDIR/config.yaml``, ``metrics.jsonl``, ``tensorboard/``,
    ``checkpoints/`` and ``summary.json``. ``on_record`` sees every metrics record.

    Raises:
      ConfigError, DataError: before any compute, for a config that cannot run.
      NonFiniteError: gradients non-finite for ``max_nonfinite_steps`` consecutive
        steps at the minimum loss scale (the last good checkpoint is kept).
    """
    out = sys.stdout if out is None else out
    options = {k: v for k, v in dataclasses.asdict(config.data).items() if k != "name"}
    data = load_dataset(config.data.name, **options, seed=config.seed)
    model = build_model(config.model, data)
    resolved = config_lib.to_dict(config)
    resolved["model"].update({k: list(v) if isinstance(v, tuple) else v for k, v in
                              ((f, getattr(model, f)) for f in config_lib.model_fields(config.model.name))})
    workdir = os.path.abspath(config.workdir)
    _check_same_experiment(workdir, resolved)

    tx, schedule = build_optimizer(config.optimizer, config.steps)
    try:
        state = create_train_state(
            model, config.precision.policy, tx, jax.random.PRNGKey(config.seed), data.sample_input(1),
            rules=config.precision.rules, loss_scale=config_lib.build_loss_scale(config.precision),
            max_grad_norm=config.optimizer.max_grad_norm, skip_with=config.precision.skip_with)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model '{config.model.name}' with {config.model.options or 'its defaults'} "
                          f"cannot be built: {e}") from None
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(resolved, f, sort_keys=False)

    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"), config.keep_checkpoints)
    start = 0
    if checkpoints.latest_step() is not None:
        state, meta = checkpoints.restore(state)
        start = int(state.step)
        if meta.get("data_position") != start:
            raise ConfigError(f"checkpoint at step {start} in {checkpoints.directory} records data position "
                              f"{meta.get('data_position')}, expected {start}: it was not written by this run")
        print(f"resuming from the checkpoint at step {start} in {checkpoints.directory}", file=out)

    writer = MetricsWriter(workdir)
    progress = Progress(config.steps, start, config.progress and start < config.steps)
    tracker = _Tracker(config, state, data, writer, progress, on_record)
    print(f"{config.model.name} on {data.describe()}; policy {state.policy} ({config.precision.policy}), "
          f"loss scale {type(state.loss_scale).__name__}; steps {start} -> {config.steps}; workdir {workdir}",
          file=out)
    train_step = make_train_step(accum_steps=config.accum_steps, learning_rate_fn=schedule)
    eval_step = make_eval_step()

    def eval_batches():
        return prefetch_to_device(data.eval_batches(config.data.eval_batch_size, config.data.eval_batches),
                                  config.data.prefetch)

    def evaluate_now(state):
        with tracker.paused():
            metrics = evaluate(eval_step, state, eval_batches(), data.task)
            tracker.record({"kind": "eval", "step": int(state.step), **metrics})
        return metrics

    def checkpoint_now(state):
        with tracker.paused():
            checkpoints.save(state, {"data_position": int(state.step), "config": resolved})

    batch_size = config.data.batch_size * config.accum_steps
    batches = prefetch_to_device(
        (b for _, b in train_batches(data, batch_size, config.seed, start)), config.data.prefetch)
    try:
        pending = None
        for step in range(start + 1, config.steps + 1):
            state, metrics = train_step(state, next(batches))
            if pending is not None:
                tracker.observe(*pending)  # the previous step's metrics: reading them does not stall this one
            pending = (step, metrics)
            due_eval = config.eval_every and step % config.eval_every == 0 and step < config.steps
            due_checkpoint = config.checkpoint_every and step % config.checkpoint_every == 0
            if due_eval or due_checkpoint:
                tracker.observe(*pending)
                pending = None
            if due_checkpoint:
                checkpoint_now(state)
            if due_eval:
                evaluate_now(state)
        if pending is not None:
            tracker.observe(*pending)
    except KeyboardInterrupt:
        saved = _save_on_interrupt(checkpoints, state, resolved, tracker)
        writer.close()
        raise KeyboardInterrupt(saved) from None
    except NonFiniteError:
        checkpoints.close()
        writer.close()
        raise
    finally:
        progress.close()
    checkpoint_now(state)
    checkpoints.close()
    eval_metrics = evaluate_now(state)
    report = {}
    if config.inference_dtypes:
        report = inference_report(state, eval_batches, data.task, config.inference_dtypes)
        for dtype, metrics in report.items():
            tracker.record({"kind": "inference", "step": int(state.step), "dtype": dtype, **metrics})
    writer.close()
    summary = tracker.summary(state, eval_metrics, report, start, workdir)
    with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(format_summary(summary), file=out)
    return summary


def _check_same_experiment(workdir: str, resolved: dict) -> None:
    path = os.path.join(workdir, "config.yaml")
    if not os.path.exists(os.path.join(workdir, "checkpoints")) or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        previous = yaml.safe_load(f) or {}
    changed = [key for key in _flat_keys(resolved) | _flat_keys(previous)
               if key not in RESUMABLE_CHANGES and _get(resolved, key) != _get(previous, key)]
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


def _save_on_interrupt(checkpoints: Checkpointer, state: TrainState, resolved: dict, tracker: "_Tracker") -> str:
    try:
        step = checkpoints.save(state, {"data_position": int(state.step), "config": resolved})
        checkpoints.close()
        message = f"interrupted; saved a checkpoint at step {step}"
    except Exception as e:  # a buffer donated to a step that never returned cannot be saved
        checkpoints.close()
        message = (f"interrupted; the current state could not be saved ({type(e).__name__}); the newest "
                   f"checkpoint is at step {checkpoints.latest_step()}")
    tracker.record({"kind": "interrupted", "step": tracker.last_step, "message": message})
    return f"{message} in {checkpoints.directory}; rerun the same command to resume"


class _Tracker:
    """Host-side bookkeeping: interval means, loss-scale events, throughput, the
    non-finite stop rule, and records to the metrics writer."""

    def __init__(self, config: ExperimentConfig, state: TrainState, data: Any, writer: MetricsWriter,
                 progress: Progress, on_record: Callable[[dict], None] | None):
        self.config, self.data, self.writer, self.on_record = config, data, writer, on_record
        self.progress = progress
        self.leaf_paths = ["params/" + "/".join(str(getattr(k, "key", k)) for k in path)
                           for path, _ in jax.tree_util.tree_leaves_with_path(state.params)]
        scale = jax.device_get(state.loss_scale)
        self.initial_scale = float(np.asarray(getattr(scale, "loss_scale", 1.0)))
        self.last_scale = self.initial_scale
        self.increases = self.decreases = 0
        self.skipped_start = int(np.asarray(getattr(scale, "skipped_steps", 0)))
        self.skipped = self.skipped_start
        self.streak_start: tuple[int, int] | None = None
        self.interval: list[dict] = []
        self.last_step = int(state.step)
        self.last_train: dict = {}
        self.examples_per_step = config.data.batch_size * config.accum_steps
        self.tokens_per_example = data.input_shape[0] if data.task == "language_model" else 1
        self.first_step_seconds: float | None = None
        self.train_seconds = 0.0
        self.steps_timed = 0
        self._mark = time.perf_counter()
        self._paused = 0.0
        self._interval_seconds = 0.0
        self._interval_steps = 0

    @contextlib.contextmanager
    def paused(self):
        """A context whose time does not count as training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start

    def record(self, record: dict) -> None:
        self.writer.write(record)
        if self.on_record is not None:
            self.on_record(record)

    def observe(self, step: int, metrics: dict) -> None:
        m = {k: np.asarray(v).item() for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        elapsed, self._mark, self._paused = now - self._mark - self._paused, now, 0.0
        if self.first_step_seconds is None:
            self.first_step_seconds = elapsed  # includes compilation
        else:
            self.train_seconds += elapsed
            self.steps_timed += 1
            self._interval_seconds += elapsed
            self._interval_steps += 1
        self.last_step = step
        scale = m["loss_scale"]
        if scale > self.last_scale:
            self.increases += 1
        elif scale < self.last_scale:
            self.decreases += 1
        self.last_scale = scale
        self.skipped = int(m["skipped_steps"])
        self.interval.append(m)
        self._check_finite(step, m)
        self.progress.update(1)
        if step % self.config.log_every == 0 or step == self.config.steps:
            self._log(step, m)

    def _check_finite(self, step: int, m: dict) -> None:
        if m["grads_finite"]:
            self.streak_start = None
            return
        if self.streak_start is None or m["nonfinite_streak"] == 1:
            self.streak_start = (step, int(m["nonfinite_leaf"]))
        k = self.config.max_nonfinite_steps
        if m["nonfinite_streak"] >= k and m["at_min_scale"]:
            first_step, leaf = self.streak_start
            path = self.leaf_paths[leaf] if 0 <= leaf < len(self.leaf_paths) else "an unknown parameter"
            ckpt = os.path.join(os.path.abspath(self.config.workdir), "checkpoints")
            message = (f"training stopped at step {step}: gradients were non-finite for {int(m['nonfinite_streak'])} "
                       f"consecutive steps (since step {first_step}) at the minimum loss scale {m['loss_scale']:g} "
                       f"(max_nonfinite_steps={k}). The first non-finite gradient, at step {first_step}, was in "
                       f"{path}. Skipped steps leave params unchanged; the last good checkpoint is kept in "
                       f"{ckpt}. Try a lower optimizer.lr, optimizer.max_grad_norm, or precision.policy=mixed_bf16.")
            self._log(step, m)
            self.record({"kind": "error", "step": step, "message": message, "param": path,
                         "first_nonfinite_step": first_step})
            raise NonFiniteError(message)

    def _log(self, step: int, m: dict) -> None:
        finite = [x for x in self.interval if x["grads_finite"]]

        def mean(key: str) -> float:
            return float(np.mean([x[key] for x in finite])) if finite else float("nan")

        rate = self._interval_steps / self._interval_seconds if self._interval_seconds > 0 else float("nan")
        record = {"kind": "train", "step": step, "loss": mean("loss"), "accuracy": mean("accuracy"),
                  "loss_scale": m["loss_scale"], "grads_finite": bool(m["grads_finite"]),
                  "grad_norm": m["grad_norm"], "skipped_steps": int(m["skipped_steps"]),
                  "nonfinite_steps": len(self.interval) - len(finite),
                  "learning_rate": m.get("learning_rate", float("nan")), "steps_per_sec": rate,
                  "examples_per_sec": rate * self.examples_per_step}
        if self.data.task == "language_model":
            record["tokens_per_sec"] = rate * self.examples_per_step * self.tokens_per_example
        self.last_train = record
        self.record(record)
        self.interval, self._interval_seconds, self._interval_steps = [], 0.0, 0
        self.progress.update(0, loss=record["loss"], scale=record["loss_scale"], steps_s=rate)

    def summary(self, state: TrainState, eval_metrics: dict | None, report: dict, start: int,
                workdir: str) -> dict:
        final_scale = float(np.asarray(getattr(jax.device_get(state.loss_scale), "loss_scale", 1.0)))
        self.increases += final_scale > self.last_scale  # the last step may have moved the scale
        self.decreases += final_scale < self.last_scale
        self.last_scale = final_scale
        rate = self.steps_timed / self.train_seconds if self.train_seconds > 0 else None
        return {
            "workdir": workdir,
            "model": self.config.model.name,
            "dataset": self.data.name,
            "policy": str(state.policy),
            "policy_spec": self.config.precision.policy,
            "loss_scale_type": type(state.loss_scale).__name__,
            "steps": int(state.step),
            "start_step": start,
            "first_step_seconds": self.first_step_seconds,
            "train_seconds": self.train_seconds,
            "steps_per_sec": rate,
            "examples_per_sec": rate * self.examples_per_step if rate else None,
            "final_train_loss": self.last_train.get("loss"),
            "eval": eval_metrics,
            "loss_scale": {"initial": self.initial_scale, "final": self.last_scale,
                           "increases": self.increases, "decreases": self.decreases,
                           "skipped_steps": self.skipped, "skipped_this_run": self.skipped - self.skipped_start},
            "inference": report,
        }


def format_summary(s: dict) -> str:
    """The end-of-run summary as a few readable lines."""
    ev = s["eval"] or {}
    lines = [f"== summary: {s['model']} on {s['dataset']}, policy {s['policy_spec']} ({s['policy']}), "
             f"{s['loss_scale_type']} =="]
    if s["steps_per_sec"]:
        lines.append(f"steps {s['start_step']} -> {s['steps']}: {s['steps_per_sec']:.1f} steps/s, "
                     f"{s['examples_per_sec']:,.0f} examples/s ({s['train_seconds']:.1f} s after a first step of "
                     f"{s['first_step_seconds']:.1f} s with compilation)")
    else:
        lines.append(f"steps {s['start_step']} -> {s['steps']}")
    final = s["final_train_loss"]
    parts = [f"final train loss {final:.4f}" if final is not None else "no training this run",
             f"eval loss {ev.get('loss', float('nan')):.4f}", f"accuracy {ev.get('accuracy', float('nan')):.4f}"]
    if "perplexity" in ev:
        parts.append(f"perplexity {ev['perplexity']:.3f}")
    lines.append(", ".join(parts))
    ls = s["loss_scale"]
    lines.append(f"loss scale {ls['initial']:g} -> {ls['final']:g}: {ls['increases']} increases, "
                 f"{ls['decreases']} decreases, {ls['skipped_this_run']} skipped steps this run "
                 f"({ls['skipped_steps']} in all)")
    if s["inference"]:
        f32 = s["inference"]["float32"]["accuracy"]
        halves = ", ".join(f"{d} {m['accuracy']:.4f} ({m['accuracy_delta']:+.4f})"
                           for d, m in s["inference"].items() if d != "float32")
        lines.append(f"inference accuracy: float32 {f32:.4f}, {halves}")
    lines.append(f"outputs in {s['workdir']}: metrics.jsonl, config.yaml, summary.json, checkpoints/, tensorboard/")
    return "\n".join(lines)
