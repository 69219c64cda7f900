"""Checkpoints with orbax: the whole train state plus the data position.

A checkpoint holds the arrays of the :class:`~train.state.TrainState` (params,
optimizer and loss-scale state, model state, RNG, step) and a small JSON record
(the data position and what produced it). Restoring needs a state of the same
structure, which the run builds anyway, so restored arrays come back with their
dtypes and shardings.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from train.state import TrainState


def _arrays(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "model_state": state.model_state, "rng": state.rng}


class Checkpointer:
    """Saves and restores train states under ``directory`` (one subdirectory per step)."""

    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, state: TrainState, meta: dict[str, Any]) -> int:
        """Saves ``state`` at its step (no-op if that step is already saved); returns the step."""
        step = int(jax.device_get(state.step))
        if step in self._manager.all_steps():
            return step
        ocp = self._ocp
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_arrays(state)),
                                                         meta=ocp.args.JsonSave(dict(meta, step=step))))
        return step

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """The state saved at ``step`` (default: the latest), in the structure of ``template``."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        ocp = self._ocp
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, _arrays(template))
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return template.replace(**restored["state"]), dict(restored["meta"])

    def wait(self) -> None:
        """Blocks until pending (asynchronous) saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
