"""``python -m train CONFIG --diagnose``: a check-up of an experiment by the numerics doctor.

Builds the experiment as :func:`train.run` would (on the config's mesh: the
state sharded and the batches split as a run places them), from its initial
state or the newest intact checkpoint in its workdir (read, never written or
moved), runs N
train steps each diagnosed (:func:`train.diagnose_state`), verifies the fixes
for the worst one, prints it and writes ``WORKDIR/diagnosis.json``.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

import jax

import precision
from train.experiment.builders import build_train_state
from train.config import ExperimentConfig
from train.data import DataError
from train.training.diagnose import diagnose_state, write_diagnosis
from train.experiment.loop import build_experiment, layout_of, start_compile_cache
from train.training.state import TrainState
from train.training.step import make_train_step

__all__ = ["diagnose_experiment"]


def diagnose_experiment(config: ExperimentConfig, steps: int = 1, out: TextIO | None = None
                        ) -> tuple[precision.Diagnosis, str]:
    """``python -m train CONFIG --diagnose``: ``steps`` train steps from the config's
    state (or its workdir's newest intact checkpoint), each diagnosed, the worst one
    verified; prints and writes ``WORKDIR/diagnosis.json``. Returns the diagnosis and
    the file's path. Checkpoints are read, never written or moved."""
    out = sys.stdout if out is None else out
    if not isinstance(steps, int) or steps < 1:
        raise DataError(f"--diagnose-steps must be an integer >= 1, got {steps!r}")
    if jax.process_count() > 1:
        raise DataError(f"--diagnose runs in one process, and this is process {jax.process_index()} of "
                        f"{jax.process_count()}: diagnose on one host (its devices can form the mesh)")
    start_compile_cache(config.compile_cache)  # a step's probed program, compiled once for all N
    data, task, model = build_experiment(config)
    layout = layout_of(config)  # the config's mesh: the state and batches are placed as a run places them
    state, schedule = build_train_state(config, model, data, layout)
    state, start = _latest_checkpoint(config, state, out)
    step_fn = make_train_step(accum_steps=config.accum_steps, learning_rate_fn=schedule, task=task, donate=False)
    batch_size = config.data.batch_size * config.accum_steps
    worst, steps_seen = None, []  # worst: (index, state, batch, diagnosis), the only state kept
    for index in range(start, start + steps):
        batch = layout.global_batch(data.train_batch(index, batch_size, config.seed), batch_size)
        found = diagnose_state(state, batch, task, verify=steps == 1)  # one step: verified in the same pass
        steps_seen.append({"step": index + 1, "healthy": found.healthy, "problems": len(found.problems),
                           "first_nonfinite": found.first_nonfinite})
        if worst is None or _severity(found) > _severity(worst[3]):
            worst = (index, state, batch, found)
        state, _ = step_fn(state, batch)
    index, state, batch, diagnosis = worst
    if not diagnosis.healthy and steps > 1:  # the worst step again, its fixes verified
        diagnosis = diagnose_state(state, batch, task)
    path = write_diagnosis(config.workdir, diagnosis, index + 1, "--diagnose", steps_seen)
    print(diagnosis, file=out)
    which = f"step {start + 1}" if steps == 1 else f"steps {start + 1}-{start + steps} (shown: step {index + 1})"
    print(f"diagnosed {which}; written to {path}", file=out)
    return diagnosis, path


def _severity(d: precision.Diagnosis) -> tuple:
    order = {"nonfinite": 3, "overflow": 3, "underflow": 2, "rounding": 1}
    return (d.first_nonfinite is not None, max((order[p.kind] for p in d.problems), default=0),
            max((p.share for p in d.problems), default=0.0))


def _latest_checkpoint(config: ExperimentConfig, state: TrainState, out: TextIO) -> tuple[TrainState, int]:
    """The newest intact checkpoint of the workdir (read only: corrupt ones are reported
    and left where they are), or ``state`` at step 0."""
    directory = os.path.join(config.workdir, "checkpoints")
    if not os.path.isdir(directory):
        return state, 0
    from train.training.checkpoint import Checkpointer

    def corrupt(step: int, reason: str) -> None:
        print(f"warning: {reason}; trying an older one", file=out)

    checkpoints = Checkpointer(directory, config.keep_checkpoints)
    try:
        restored = checkpoints.restore_latest_good(state, on_corrupt=corrupt, set_aside=False)
    finally:
        checkpoints.close()
    if restored is None:
        return state, 0
    state, _ = restored
    step = int(state.step)
    print(f"diagnosing from the checkpoint at step {step} in {directory}", file=out)
    return state, step
