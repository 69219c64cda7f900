"""Host-side bookkeeping of a run: step metrics read in batches, interval means,
loss-scale events, throughput (tokens/s for language models), the non-finite
stop rule, metrics records and the end-of-run summary."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from train.parallel.distributed import to_host
from train.tracking.metrics import MetricsWriter, Progress
from train.training.state import TrainState
from train.training.tasks import RESERVED_METRICS
from train.training.tree_paths import leaf_names

__all__ = ["NonFiniteError", "TrackedRun", "Tracker", "format_summary", "model_label"]


def model_label(name: str) -> str:
    """A model name for people: ``MLP (nnx_mlp.py)`` for a reference to user code."""
    where, sep, attr = name.rpartition(":")
    return f"{attr} ({os.path.basename(where)})" if sep else name


class NonFiniteError(RuntimeError):
    """Gradients stayed non-finite at the minimum loss scale; training cannot recover by itself.
    ``first_step``: the first step of the streak (its batch is the one the doctor diagnoses)."""

    def __init__(self, message: str, first_step: int | None = None):
        super().__init__(message)
        self.first_step = first_step


class TrackedRun(NamedTuple):
    """What the tracker knows of the run it books (from the experiment's config)."""

    model: str  # model.name
    policy_spec: str  # precision.policy as the config gives it
    steps: int  # the step the run ends at
    log_every: int
    max_nonfinite_steps: int
    examples_per_step: int  # data.batch_size x accum_steps


class Tracker:
    """Host-side bookkeeping: interval means, loss-scale events, throughput, the
    non-finite stop rule, and records to the metrics writer."""

    def __init__(self, run: TrackedRun, state: TrainState, data: Any, task: Any, writer: MetricsWriter,
                 progress: Progress, on_record: Callable[[dict], None] | None, notes: list[str] | None = None):
        self.run, self.data, self.writer, self.on_record = run, data, writer, on_record
        self.notes = list(notes or [])  # what the summary repeats of the run's header (the fp8 share)
        self.language_model = task.name == "language_model"
        self.progress = progress
        self.leaf_paths = ["params/" + name for name in leaf_names(state.params)]
        scale = to_host(state.loss_scale)
        self.initial_scale = float(np.asarray(getattr(scale, "loss_scale", 1.0)))
        self.last_scale = self.initial_scale
        self.increases = self.decreases = 0
        self.skipped_start = int(np.asarray(getattr(scale, "skipped_steps", 0)))
        self.skipped = self.skipped_start
        self.streak_start: tuple[int, int] | None = None  # (step, nonfinite_leaf) where the streak began
        self.streak = 0  # consecutive skipped steps no lower loss scale could have saved
        self.streak_loss_only = True  # every step of the streak: the loss non-finite, its gradients finite
        self.applied_steps = 0  # steps of this run whose update was applied (finite loss and gradients)
        self.first_skip: tuple[int, int] | None = None  # (step, nonfinite_leaf) of this run's first skipped step
        self.dynamic_scale = hasattr(scale, "min_loss_scale")
        self.at_min_scale_step: int | None = None  # first non-finite step of a dynamic scale at its minimum
        self.scale_in_use = self.initial_scale  # the loss scale of the newest step with finite gradients
        self.interval: list[dict] = []
        self.last_step = int(to_host(state.step))
        self.run_start = self.last_step  # the step this run started from (a resumed run: its checkpoint's)
        self.last_train: dict = {}
        self.examples_per_step = run.examples_per_step
        self.tokens_per_example = data.input_shape[0] if self.language_model else 1
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

    def observe(self, calls: list[tuple[int, int | None, Any]]) -> None:
        """Reads the metrics of ``calls`` in one transfer and books them, step by step:
        loss-scale moves, the non-finite stop rule, interval means, logs.

        A call is ``(first_step, count, metrics)``: ``count`` steps whose metrics are
        stacked (:func:`train.make_multi_step`), or ``None`` for one step's scalars.
        """
        if not calls:
            return
        host = to_host([metrics for _, _, metrics in calls])
        now = time.perf_counter()
        elapsed, self._mark, self._paused = now - self._mark - self._paused, now, 0.0
        timed = sum(1 if count is None else count for _, count, _ in calls)
        if self.first_step_seconds is None:  # the first read is of the first step alone, compilation included
            self.first_step_seconds, elapsed, timed = elapsed, 0.0, 0
        self.train_seconds += elapsed
        self.steps_timed += timed
        self._interval_seconds += elapsed
        self._interval_steps += timed
        for (first, count, _), metrics in zip(calls, host):
            if count is None:
                self._book(first, {k: np.asarray(v).item() for k, v in metrics.items()})
                continue
            columns = {k: np.asarray(v)[:count].tolist() for k, v in metrics.items()}
            for i in range(count):
                self._book(first + i, {k: v[i] for k, v in columns.items()})

    def _book(self, step: int, m: dict) -> None:
        self.last_step = step
        scale = m["loss_scale"]
        if scale > self.last_scale:
            self.increases += 1
        elif scale < self.last_scale:
            self.decreases += 1
        self.last_scale = scale
        if m.get("grads_finite", True):
            self.scale_in_use = scale
        self.skipped = int(m["skipped_steps"])
        self.interval.append(m)
        self._check_finite(step, m)
        if step % self.run.log_every == 0 or step == self.run.steps:
            self._log(step, m)

    def _check_finite(self, step: int, m: dict) -> None:
        """The stop rules (:class:`NonFiniteError`): a streak no lower loss scale could have
        saved (:meth:`_check_streak`), and a run that reached its last step with none of its
        steps applied, whatever its loss scale did: it trained nothing."""
        skipped = not m["grads_finite"]
        if not skipped:
            self.applied_steps += 1
        elif self.first_skip is None:
            self.first_skip = (step, int(m["nonfinite_leaf"]))
        self._check_streak(step, m, skipped)
        if skipped and not self.applied_steps and step >= self.run.steps:
            self._stop_with_nothing_applied(step, m)

    def _stop_with_nothing_applied(self, step: int, m: dict) -> None:
        """Raises :class:`NonFiniteError`: every step of this run, up to its last, was skipped."""
        first_step, leaf = self.first_skip
        count = step - self.run_start
        scales = (f"at loss scale {m['loss_scale']:g}" if m["loss_scale"] == self.initial_scale
                  else f"at loss scales from {self.initial_scale:g} down to {m['loss_scale']:g}")
        message = (f"none of the {count} steps of this run was applied: each was skipped for a non-finite loss or "
                   f"gradients ({scales}), so the run trained nothing. At step {first_step}, {self._culprit(leaf)}.")
        self._log(step, m)
        self.record({"kind": "error", "step": step, "message": message, "param": self._leaf_path(leaf),
                     "first_nonfinite_step": first_step})
        raise NonFiniteError(message, first_step)

    def _check_streak(self, step: int, m: dict, skipped: bool) -> None:
        """The streak rule: ``max_nonfinite_steps`` consecutive skipped steps (or every step of
        a shorter run) that no lower loss scale could have saved: each used the lowest scale
        there is, or its loss itself was non-finite while its gradients were finite (a scale
        cannot fix that)."""
        loss_only = skipped and int(m["nonfinite_leaf"]) == -1
        if not skipped or not (m["at_min_scale"] or loss_only):
            self.streak_start, self.streak, self.streak_loss_only = None, 0, True
            return
        if self.streak_start is None:
            self.streak_start, self.streak_loss_only = (step, int(m["nonfinite_leaf"])), True
            if self.dynamic_scale and self.at_min_scale_step is None and not loss_only:
                self.at_min_scale_step = step
        self.streak += 1
        self.streak_loss_only = self.streak_loss_only and loss_only
        k = self.run.max_nonfinite_steps
        whole_run = self.streak >= self.run.steps - self.run_start  # a run shorter than k: nothing trained
        if self.streak >= k or whole_run:
            first_step, leaf = self.streak_start
            steps = (f"{self.streak} consecutive steps" if self.streak >= k
                     else f"all {self.streak} steps of this run")
            if self.streak_loss_only:
                message = (f"the loss itself was non-finite, while its gradients were finite, for {steps} "
                           f"(since step {first_step}; max_nonfinite_steps={k}): no loss scale "
                           f"can fix that. Check the task's loss and the data (a log of 0, a division by zero, NaN "
                           f"or inf in the inputs or labels).")
            else:
                message = (f"gradients were non-finite for {steps} (since step "
                           f"{first_step}) at the minimum loss scale {m['loss_scale']:g} "
                           f"(max_nonfinite_steps={k}). At step {first_step}, {self._culprit(leaf)}. Try a lower "
                           f"optimizer.lr, optimizer.max_grad_norm, or precision.policy=mixed_bf16.")
            self._log(step, m)
            self.record({"kind": "error", "step": step, "message": message, "param": self._leaf_path(leaf),
                         "first_nonfinite_step": first_step})
            raise NonFiniteError(message, first_step)

    def _leaf_path(self, leaf: int) -> str | None:
        index = leaf if leaf >= 0 else -2 - leaf
        return self.leaf_paths[index] if leaf != -1 and 0 <= index < len(self.leaf_paths) else None

    def _culprit(self, leaf: int) -> str:
        """What ``nonfinite_leaf`` says went wrong, in words."""
        path = self._leaf_path(leaf)
        if leaf >= 0:
            return f"the first non-finite gradient was in {path or 'an unknown parameter'}"
        if leaf < -1:
            return (f"every gradient was finite but their global norm overflowed float32, the largest in "
                    f"{path or 'an unknown parameter'}")
        return "the loss was non-finite while its gradients were finite"

    def _log(self, step: int, m: dict) -> None:
        finite = [x for x in self.interval if x["grads_finite"]]

        def mean(key: str) -> float:
            return float(np.mean([x[key] for x in finite])) if finite else float("nan")

        rate = self._interval_steps / self._interval_seconds if self._interval_seconds > 0 else float("nan")
        task_metrics = {k: mean(k) for k in m if k not in RESERVED_METRICS}
        record = {"kind": "train", "step": step, "loss": mean("loss"), **task_metrics,
                  "loss_scale": m["loss_scale"], "grads_finite": bool(m["grads_finite"]),
                  "grad_norm": m["grad_norm"], "skipped_steps": int(m["skipped_steps"]),
                  "nonfinite_steps": len(self.interval) - len(finite),
                  "learning_rate": m.get("learning_rate", float("nan")), "steps_per_sec": rate,
                  "examples_per_sec": rate * self.examples_per_step}
        if self.language_model:
            record["tokens_per_sec"] = rate * self.examples_per_step * self.tokens_per_example
        self.last_train = record
        self.record(record)
        self.interval, self._interval_seconds, self._interval_steps = [], 0.0, 0
        self.progress.update(0, loss=record["loss"], scale=record["loss_scale"], steps_s=rate)

    def summary(self, state: TrainState, eval_metrics: dict | None, report: dict, start: int,
                workdir: str) -> dict:
        final_scale = float(np.asarray(getattr(to_host(state.loss_scale), "loss_scale", 1.0)))
        self.increases += final_scale > self.last_scale  # the last step may have moved the scale
        self.decreases += final_scale < self.last_scale
        self.last_scale = final_scale
        rate = self.steps_timed / self.train_seconds if self.train_seconds > 0 else None
        return {
            "workdir": workdir,
            "model": model_label(self.run.model),
            "dataset": self.data.name,
            "policy": str(state.policy),
            "policy_spec": self.run.policy_spec,
            "loss_scale_type": type(state.loss_scale).__name__,
            "steps": int(to_host(state.step)),
            "start_step": start,
            "steps_asked": self.run.steps,
            "first_step_seconds": self.first_step_seconds,
            "train_seconds": self.train_seconds,
            "steps_per_sec": rate,
            "examples_per_sec": rate * self.examples_per_step if rate else None,
            "tokens_per_sec": rate * self.examples_per_step * self.tokens_per_example
            if rate and self.language_model else None,
            "final_train_loss": self.last_train.get("loss"),
            "eval": eval_metrics,
            "loss_scale": {"initial": self.initial_scale, "final": self.last_scale,
                           "increases": self.increases, "decreases": self.decreases,
                           "skipped_steps": self.skipped, "skipped_this_run": self.skipped - self.skipped_start},
            "inference": report,
            "notes": self.notes,
        }


def format_summary(s: dict) -> str:
    """The end-of-run summary as a few readable lines."""
    ev = s["eval"] or {}
    lines = [f"== summary: {s['model']} on {s['dataset']}, policy {s['policy_spec']} ({s['policy']}), "
             f"{s['loss_scale_type']} =="]
    if s["steps_per_sec"]:
        lines.append(f"steps {s['start_step']} -> {s['steps']}: {s['steps_per_sec']:.1f} steps/s, "
                     f"{s['examples_per_sec']:,.0f} examples/s"
                     + (f", {s['tokens_per_sec']:,.0f} tokens/s" if s.get("tokens_per_sec") else "")
                     + f" ({s['train_seconds']:.1f} s after a first step of "
                     f"{s['first_step_seconds']:.1f} s with compilation)")
    else:
        lines.append(f"steps {s['start_step']} -> {s['steps']}")
    final = s["final_train_loss"]
    idle = "no training this run"
    if final is None and s["start_step"] >= s.get("steps_asked", s["start_step"] + 1):
        idle += (f" (the workdir's checkpoint is at step {s['start_step']}, at or past steps={s['steps_asked']}: give "
                 f"a higher steps to continue it, or a new workdir= to start afresh)")
    parts = [f"final train loss {final:.4f}" if final is not None else idle,
             f"eval loss {ev.get('loss', float('nan')):.4f}"]
    parts += [f"{k} {v:.4f}" for k, v in ev.items() if k != "loss"]
    lines.append(", ".join(parts))
    ls = s["loss_scale"]
    lines.append(f"loss scale {ls['initial']:g} -> {ls['final']:g}: {ls['increases']} increases, "
                 f"{ls['decreases']} decreases, {ls['skipped_this_run']} skipped steps this run "
                 f"({ls['skipped_steps']} in all)")
    if s["inference"] and "accuracy" in s["inference"]["float32"]:
        f32 = s["inference"]["float32"]["accuracy"]
        halves = ", ".join(f"{d} {m['accuracy']:.4f} ({m['accuracy_delta']:+.4f})"
                           for d, m in s["inference"].items() if d != "float32")
        lines.append(f"inference accuracy: float32 {f32:.4f}, {halves}")
    lines += s.get("notes", [])
    lines.append(f"outputs in {s['workdir']}: metrics.jsonl, config.yaml, summary.json, checkpoints/, tensorboard/")
    return "\n".join(lines)
