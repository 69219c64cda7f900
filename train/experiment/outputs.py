"""What a run keeps in its workdir: ``config.yaml``, metrics records (and a Weights & Biases run), checkpoints
(restored from the newest intact one, saved on a stop), and the libraries' log;
and what it says on the console."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Callable, Iterator, TextIO

import jax

from train.training.checkpoint import CheckpointError, Checkpointer
from train.config import ConfigError, ExperimentConfig
from train.parallel.distributed import to_host
from train.tracking.metrics import MetricsWriter, NullWriter
from train.training.state import TrainState, explain_model
from train.tracking.tracker import Tracker
from train.tracking.wandb_logger import WandbLogger
from train.experiment.workdir import check_writable, write_config

__all__ = ["Outputs", "restore", "save_last_good", "save_on_interrupt"]


class Outputs:
    """What a run writes to its workdir (``config.yaml``, metrics records and
    checkpoints; process 0 all but its checkpoint shards) and to the console."""

    def __init__(self, config: ExperimentConfig, resolved: dict, out: TextIO,
                 on_record: Callable[[dict], None] | None, data: Any = None):
        self.workdir = check_writable(config.workdir, "workdir")
        self.resolved, self.out, self.on_record, self.data = resolved, out, on_record, data
        primary = jax.process_index() == 0
        if primary:
            write_config(self.workdir, resolved)
        self.writer = MetricsWriter(self.workdir, config.tracker.tensorboard) if primary else NullWriter()
        self.wandb_settings = config.tracker.wandb if primary and config.tracker.wandb.enabled else None
        self.wandb: WandbLogger | None = None  # while tracking()
        self.library_log = os.path.join(self.workdir, "train.log" if primary else f"train.{jax.process_index()}.log")
        self.keep_checkpoints = config.keep_checkpoints

    @functools.cached_property
    def checkpoints(self) -> Checkpointer:
        """The workdir's checkpoints, opened where first used: inside the run's library log
        (``library_log``), where what orbax says of a corrupt checkpoint's metadata as it reads
        them goes, not to the terminal."""
        return Checkpointer(os.path.join(self.workdir, "checkpoints"), self.keep_checkpoints)

    def record(self, record: dict) -> None:
        self.writer.write(record)
        if self.on_record is not None:
            self.on_record(record)

    def checkpoint(self, state: TrainState) -> int:
        """Saves ``state`` with the data position it resumes from (and a stream's, which the data records)."""
        step = int(to_host(state.step))
        meta = {"data_position": step, "config": self.resolved}
        data_state = getattr(self.data, "checkpoint_state", lambda _: None)(step)
        return self.checkpoints.save(state, meta if data_state is None else dict(meta, data_state=data_state))

    def close(self) -> None:
        self.checkpoints.close()
        self.writer.close()

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Weights & Biases (``tracker.wandb``, process 0) while inside: the config, every record,
        finished with the run's exit status (:func:`train.tracking.wandb_logger.exit_status`)."""
        if self.wandb_settings is None:
            yield
            return
        self.wandb = WandbLogger.from_config(self.wandb_settings, self.workdir, self.resolved, self.out)
        user_hook = self.on_record

        def on_record(record: dict) -> None:
            self.wandb.log(record)
            if user_hook is not None:
                user_hook(record)

        self.on_record = on_record
        with self.wandb:
            yield

    def report_precision(self, state: TrainState, sample_input: Any, notes: list[str]) -> None:
        """The precision report for W&B (when it logs): the policy, the header's notes and
        :func:`precision.explain` of the model on ``sample_input``, per module."""
        if self.wandb is None or not self.wandb.active:
            return
        try:
            explanation = explain_model(state.model, sample_input, train=True, backward=True, inputs_as=state.inputs_as)
        except Exception:  # the report is for reading; the run does not depend on it
            logging.getLogger("train").warning("precision.explain failed for the W&B report", exc_info=True)
            explanation = None
        self.wandb.log_precision(explanation, policy=str(state.policy),
                                 policy_spec=self.resolved["precision"]["policy"],
                                 loss_scale=type(state.loss_scale).__name__, notes="\n".join(notes))

    def log_summary(self, summary: dict) -> None:
        """The end-of-run summary as the W&B run's summary (when it logs)."""
        if self.wandb is not None:
            self.wandb.log_summary(summary)


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
    note = getattr(outputs.data, "resume", lambda *_: None)(start, meta.get("data_state"))
    if note:
        print(note, file=outputs.out)
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
