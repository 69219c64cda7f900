"""What a run keeps in its workdir: ``config.yaml``, metrics records, checkpoints
(restored from the newest intact one, saved on a stop), and the libraries' log;
and what it says on the console."""

from __future__ import annotations

import os
from typing import Callable, TextIO

import jax

from train.checkpoint import CheckpointError, Checkpointer
from train.config import ConfigError, ExperimentConfig
from train.distributed import to_host
from train.metrics import MetricsWriter, NullWriter
from train.state import TrainState
from train.tracker import Tracker
from train.workdir import check_writable, write_config

__all__ = ["Outputs", "restore", "save_last_good", "save_on_interrupt"]


class Outputs:
    """What a run writes to its workdir (``config.yaml``, metrics records and
    checkpoints; process 0 all but its checkpoint shards) and to the console."""

    def __init__(self, config: ExperimentConfig, resolved: dict, out: TextIO,
                 on_record: Callable[[dict], None] | None):
        self.workdir = check_writable(config.workdir, "workdir")
        self.resolved, self.out, self.on_record = resolved, out, on_record
        primary = jax.process_index() == 0
        if primary:
            write_config(self.workdir, resolved)
        self.writer = MetricsWriter(self.workdir) if primary else NullWriter()
        self.library_log = os.path.join(self.workdir, "train.log" if primary else f"train.{jax.process_index()}.log")
        self.checkpoints = Checkpointer(os.path.join(self.workdir, "checkpoints"), config.keep_checkpoints)

    def record(self, record: dict) -> None:
        self.writer.write(record)
        if self.on_record is not None:
            self.on_record(record)

    def checkpoint(self, state: TrainState) -> int:
        """Saves ``state`` with the data position it resumes from."""
        return self.checkpoints.save(state, {"data_position": int(to_host(state.step)), "config": self.resolved})

    def close(self) -> None:
        self.checkpoints.close()
        self.writer.close()


def restore(outputs: Outputs, state: TrainState) -> tuple[TrainState, int]:
    """The newest intact checkpoint of the workdir and its step (``state`` and 0 if none).
    Corrupt ones are set aside, reported and skipped."""
    def corrupt(step: int, reason: str) -> None:
        print(f"warning: {reason}; falling back to the previous checkpoint", file=outputs.out)
        outputs.record({"kind": "checkpoint_corrupt", "step": step, "message": reason})

    try:
        restored = outputs.checkpoints.restore_latest_good(state, on_corrupt=corrupt)
    except CheckpointError:
        outputs.close()
        raise
    if restored is None:
        return state, 0
    state, meta = restored
    start = int(to_host(state.step))
    if meta.get("data_position") != start:
        outputs.close()
        raise ConfigError(f"checkpoint at step {start} in {outputs.checkpoints.directory} records data position "
                          f"{meta.get('data_position')}, expected {start}: it was not written by this run")
    print(f"resuming from the checkpoint at step {start} in {outputs.checkpoints.directory}", file=outputs.out)
    return state, start


def save_last_good(outputs: Outputs, state: TrainState, tracker: Tracker) -> str:
    """Checkpoints the state after a non-finite stop (waiting until it is on disk); what to
    add to its message. The metrics writer stays open for what the caller records next."""
    try:
        with tracker.paused():
            outputs.checkpoint(state)
        outputs.checkpoints.close()
        note = (f" Skipped steps leave params unchanged: the state where training stopped is checkpointed at step "
                f"{int(to_host(state.step))} in {outputs.checkpoints.directory}.")
    except CheckpointError as save_error:
        note = f" Saving the last good state failed: {save_error}"
    return note


def save_on_interrupt(outputs: Outputs, state: TrainState, tracker: Tracker) -> str:
    """Checkpoints the state on Ctrl-C (when its buffers survived); the message to raise."""
    checkpoints = outputs.checkpoints
    try:
        step = outputs.checkpoint(state)
        checkpoints.close()
        message = f"interrupted; saved a checkpoint at step {step}"
    except Exception as e:  # a buffer donated to a step that never returned cannot be saved
        checkpoints.close()
        step = checkpoints.latest_step()
        message = (f"interrupted; the current state could not be saved ({type(e).__name__}); the newest "
                   f"checkpoint is at step {step}")
    # the step a resume starts from (the metrics read so far may end a few steps earlier)
    tracker.record({"kind": "interrupted", "step": step, "message": message})
    return f"{message} in {checkpoints.directory}; rerun the same command to resume"
