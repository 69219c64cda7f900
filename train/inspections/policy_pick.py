"""``python -m train CONFIG --pick-policy``: which precision policy for this experiment, on this
machine, by measurement.

Builds the experiment once, measures every candidate policy on the same batches
(:mod:`train.inspections.policy_measure`: the doctor's numerics, the loss after N steps, step
times and memory), lets :func:`precision.pick_policy` decide, prints the table,
and writes ``WORKDIR/policy_pick.json`` and ``WORKDIR/policy_pick.yaml`` (a
``precision:`` fragment for the config; the same as ``key=value`` overrides is
printed). See docs/policy-pick.md.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Iterable, TextIO

import jax

import precision
from precision.pick import check_choice, parse_candidates
from train.config import ConfigError, ExperimentConfig
from train.data import DataError
from train.experiment.loop import build_experiment, layout_of, start_compile_cache
from train.inspections.policy_measure import Experiment, measure_candidate
from train.experiment.workdir import check_writable

__all__ = ["DEFAULT_STEPS", "EVAL_BATCHES", "pick_policy", "write_pick"]

#: Train steps per candidate when not given (fewer when the config trains fewer).
DEFAULT_STEPS = 30
#: Eval batches the loss after the steps is measured on (at most; fewer when the config says so).
EVAL_BATCHES = 4


def pick_policy(config: ExperimentConfig, candidates: "str | Iterable[str | precision.Candidate] | None" = None,
                steps: int | None = None, tolerance: float = 0.01, prefer: str = "speed",
                out: TextIO | None = None) -> precision.PolicyPick:
    """Measures each candidate policy on the experiment ``config`` describes and picks
    the fastest (``prefer="speed"``) or leanest (``"memory"``) whose loss after ``steps``
    steps is within ``tolerance`` (relative) of float32's and whose step fits the
    device; prints the table and writes ``WORKDIR/policy_pick.json`` and ``.yaml``.

    ``candidates``: policies or presets, each optionally followed by ``key=value``
    precision settings (``"mixed_f16 rules=[[block, f32]]"``); a string separates
    them with ``;``. Default: :data:`precision.pick.DEFAULT_CANDIDATES`. float32 is
    always measured: it is the reference.

    Raises:
      ValueError: ``steps``, ``tolerance`` or ``prefer`` out of range (one line).
      precision.PolicyError: an unknown candidate (naming the nearest preset), or no
        candidate eligible (each one's reason).
      ConfigError, DataError: the experiment cannot be built, or every candidate failed.
    """
    out = sys.stdout if out is None else out
    check_choice(tolerance, prefer)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an integer >= 1 (train steps per candidate), got {steps!r}")
    chosen = parse_candidates(candidates)
    if jax.process_count() > 1:
        raise DataError(f"--pick-policy runs in one process, and this is process {jax.process_index()} of "
                        f"{jax.process_count()}: pick on one host")
    workdir = check_writable(config.workdir, "workdir")
    steps = min(steps or DEFAULT_STEPS, config.steps)
    began = time.perf_counter()
    experiment = _experiment(config, steps)
    measured: dict[str, precision.Measurement] = {}
    reference_loss = None
    for candidate in sorted(chosen, key=lambda c: not _is_reference(c)):  # float32 first: the others' yardstick
        start = time.perf_counter()
        m = measured[candidate.name] = measure_candidate(experiment, candidate, reference_loss, tolerance)
        if m.is_reference and reference_loss is None:
            reference_loss = m.loss
        what = m.error or (f"numerics {m.numerics}" + (f", loss {m.loss:.4g}" if m.loss is not None else ""))
        print(f"measured {candidate.name}: {what} ({time.perf_counter() - start:.1f} s)", file=out, flush=True)
    measured = [measured[c.name] for c in chosen]
    errors = {m.error for m in measured}
    if None not in errors:  # the same error under every policy is the config's: as a run would say it
        raise ConfigError(errors.pop() if len(errors) == 1 else "the config fails under every candidate: "
                          + "; ".join(f"{m.name}: {m.error}" for m in measured))
    pick = precision.pick_policy(measured, tolerance, prefer, backend=jax.default_backend())
    print(f"\n{pick.table()}", file=out)
    paths = write_pick(pick, workdir, steps, time.perf_counter() - began)
    print(f"\nuse it: python -m train CONFIG {' '.join(shlex.quote(o) for o in pick.overrides)}\n"
          f"or merge into the config:\n{pick.fragment}wrote {paths[0]} and {paths[1]}", file=out)
    return pick


def _is_reference(candidate: precision.Candidate) -> bool:
    return precision.get_policy(candidate.policy) == precision.get_policy("fp32") and not candidate.settings


def _experiment(config: ExperimentConfig, steps: int) -> Experiment:
    """The data, task, model and layout, built once, and the batches every candidate trains and is evaluated on."""
    start_compile_cache(config.compile_cache)  # a rerun compiles nothing
    data, task, model = build_experiment(config)
    layout = layout_of(config)
    size = config.data.batch_size * config.accum_steps
    batches = [layout.global_batch(data.train_batch(i, size, config.seed), size) for i in range(steps)]
    count = min(EVAL_BATCHES, config.data.eval_batches or EVAL_BATCHES)
    eval_size = config.data.eval_batch_size
    eval_batches = [layout.global_batch(b, eval_size) for b in data.eval_batches(eval_size, count)][:count]
    return Experiment(config, data, task, model, layout, batches, eval_batches)


def write_pick(pick: precision.PolicyPick, workdir: str, steps: int, seconds: float) -> tuple[str, str]:
    """``WORKDIR/policy_pick.json`` (every measurement) and ``WORKDIR/policy_pick.yaml`` (the fragment)."""
    json_path, yaml_path = os.path.join(workdir, "policy_pick.json"), os.path.join(workdir, "policy_pick.yaml")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump({**pick.to_dict(), "steps": steps, "seconds": round(seconds, 2)}, f, indent=2, default=str)
    with open(yaml_path, "w", encoding="utf-8") as f:
        f.write(f"# python -m train CONFIG --pick-policy: {pick.choice.name} ({pick.prefer}; see policy_pick.json)\n"
                + pick.fragment)
    return json_path, yaml_path
