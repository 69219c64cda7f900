"""Checkpoints with orbax: the whole train state, the data position, and a
fingerprint that proves what comes back is what went in.

A checkpoint holds the arrays of the :class:`~train.training.state.TrainState` (params,
optimizer and loss-scale state, model state, RNG, step) and a small JSON record
(the data position, what produced it, and a fingerprint of every array).
Restoring needs a state of the same structure, which the run builds anyway, so
restored arrays come back with their dtypes and the template's shardings, on
any number of devices and processes.

Faults, and what they cost:

* a process killed mid-write leaves an unfinished temporary directory that is
  never taken for a checkpoint (orbax renames a step into place only when every
  process has finished writing it);
* a truncated or corrupted checkpoint fails to read or fails its fingerprint:
  it is moved aside to ``checkpoints.corrupt/`` (kept, never deleted) and the
  previous one is used;
* a failed write (disk full, permissions) raises :class:`CheckpointError` naming
  the directory, the cause and the steps still intact; the unfinished write is
  removed. A directory that can no longer be written (read-only, permissions
  lost) is found before orbax starts its asynchronous write, which would wait
  minutes for a directory it cannot create.
"""

from __future__ import annotations

import errno
import glob
import functools
import os
import re
import tempfile
import shutil
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from train.parallel.distributed import to_host
from train.training.state import TrainState
from train.training.tree_paths import leaf_names, leaf_shapes

__all__ = ["CheckpointError", "Checkpointer", "fingerprint"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which, where, and what is intact."""


def _arrays(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "model_state": state.model_state, "rng": state.rng}


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (16-bit and narrower values widened, 64-bit split)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    bits = x.dtype.itemsize * 8
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


#: The fingerprint a checkpoint's record holds: 2 weighs each word by an odd number, so any change of
#: one word (any single bit flip) changes it; 1 (records without a version) missed some high-bit flips.
FINGERPRINT_VERSION = 2


@functools.partial(jax.jit, static_argnums=1)
def _fingerprint_leaves(leaves: list[jax.Array], version: int) -> list[jax.Array]:
    out = []
    for leaf in leaves:
        words = _words(leaf)
        index = jnp.arange(1, words.size + 1, dtype=jnp.uint32)
        if version == 1:
            position = index * jnp.uint32(2654435761)
            out.append(jnp.sum(words * position + (words ^ position), dtype=jnp.uint32))  # wraps mod 2**32
        else:  # an odd weight is invertible mod 2**32: a word changed by d != 0 changes the sum by d * odd != 0
            odd = (index * jnp.uint32(2) - jnp.uint32(1)) * jnp.uint32(2654435761)
            out.append(jnp.sum(words * odd, dtype=jnp.uint32))
    return out


def fingerprint(tree: Any, version: int = FINGERPRINT_VERSION) -> dict[str, int]:
    """A position-weighted checksum (mod 2**32) of every array's bits, by leaf name.

    Any change to one word of an array changes its value; computed on the
    devices, sharded or not, so it costs one pass over the state. ``version``:
    that of the record being checked (1 for checkpoints written before version 2).
    """
    leaves = jax.tree_util.tree_leaves(tree)
    sums = to_host(_fingerprint_leaves(leaves, version))
    return {name: int(v) for name, v in zip(leaf_names(tree), sums)}


class Checkpointer:
    """Saves and restores train states under ``directory`` (one subdirectory per step).

    Saves are asynchronous: the write of one checkpoint overlaps the training
    steps after it, and its errors are raised by the next :meth:`save`,
    :meth:`wait` or :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        self.quarantine = self.directory.rstrip(os.sep) + ".corrupt"
        self._pending: int | None = None
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
                item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
        except OSError as e:
            raise CheckpointError(f"cannot use checkpoint directory {self.directory}: {e}") from None

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, state: TrainState, meta: dict[str, Any]) -> int:
        """Starts saving ``state`` at its step (no-op if that step is saved); returns the step.

        Raises:
          CheckpointError: this or the previous write failed (e.g. disk full).
        """
        step = int(to_host(state.step))
        self.wait()
        if step in self._manager.all_steps():
            return step
        try:  # before orbax's asynchronous save, whose threads wait minutes for a directory they cannot create
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".write-check-"):
                pass
        except OSError as e:
            self._write_failed(step, e)
        ocp = self._ocp
        arrays = _arrays(state)
        record = dict(meta, step=step, fingerprint=fingerprint(arrays), fingerprint_version=FINGERPRINT_VERSION)
        self._pending = step
        try:
            self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                                             meta=ocp.args.JsonSave(record)))
        except Exception as e:  # noqa: BLE001 - any failure to write is reported the same way
            self._write_failed(step, e)
        return step

    def wait(self) -> None:
        """Blocks until pending saves are on disk.

        Raises:
          CheckpointError: the pending write failed.
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._write_failed(self._pending, e)
        self._pending = None

    def _write_failed(self, step: int | None, error: Exception) -> None:
        self._pending = None
        partials = glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*"))
        for partial in partials:
            if jax.process_index() == 0:
                shutil.rmtree(partial, ignore_errors=True)
        self._manager.reload()
        free = shutil.disk_usage(self.directory).free if os.path.isdir(self.directory) else 0
        intact = self.all_steps()
        raise CheckpointError(
            f"could not write the checkpoint at step {step} to {self.directory}: {_short(error)}. "
            f"{free / 2 ** 20:,.1f} MiB free there. Checkpoints still intact: "
            f"{', '.join(map(str, intact)) or 'none'}{'; the unfinished write was removed' if partials else ''}. "
            f"{_remedy(error, self.directory)} (or set workdir=...) and rerun the same command to resume"
            + (f" from step {intact[-1]}." if intact else "."))

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """The state saved at ``step`` (default: the latest), in the structure of ``template``.

        Raises:
          FileNotFoundError: there is no checkpoint.
          CheckpointError: the checkpoint cannot be read, fails its fingerprint, or
            holds arrays of other shapes than ``template``.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        where = os.path.join(self.directory, str(step))
        ocp = self._ocp
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, _arrays(template))
        try:
            saved = self._manager.item_metadata(step)["state"]
            saved = getattr(saved, "tree", saved)
        except Exception as e:  # noqa: BLE001
            raise _Corrupt(f"checkpoint {where} has unreadable metadata: {_short(e)}") from None
        if not jax.tree_util.tree_leaves(saved):
            raise _Corrupt(f"checkpoint {where} has lost its array metadata")
        _check_matches(saved, abstract, where)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
            state, meta = restored["state"], dict(restored["meta"])
        except Exception as e:  # noqa: BLE001
            raise _Corrupt(f"checkpoint {where} cannot be read: {_short(e)}") from None
        expected = meta.get("fingerprint")
        if not isinstance(expected, dict):  # lost with its record: nothing proves the arrays are what was saved
            raise _Corrupt(f"checkpoint {where} has no fingerprint record, so its arrays cannot be checked")
        actual = fingerprint(state, int(meta.get("fingerprint_version", 1)))
        bad = [name for name in actual if expected.get(name) != actual[name]]
        if bad:
            raise _Corrupt(f"checkpoint {where} is corrupted: {len(bad)} of {len(actual)} arrays differ from "
                           f"what was saved ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
        return template.replace(**state), meta

    def restore_latest_good(self, template: TrainState, on_corrupt: Callable[[int, str], None] | None = None,
                            set_aside: bool = True) -> tuple[TrainState, dict[str, Any]] | None:
        """The newest checkpoint that reads back intact, or None if there is none.

        Each corrupted checkpoint met on the way is moved to
        ``<directory>.corrupt/`` (left where it is if not ``set_aside``: a reader
        that must not change the workdir) and reported through ``on_corrupt(step, reason)``.

        Raises:
          CheckpointError: checkpoints exist but none is intact, or they do not
            fit ``template`` (another model).
        """
        tried = []
        for step in reversed(self.all_steps()):
            try:
                return self.restore(template, step)
            except _Corrupt as e:
                tried.append(step)
                reason = f"{e}; moved to {self._quarantine(step)}" if set_aside else str(e)
                if on_corrupt is not None:
                    on_corrupt(step, reason)
        if tried:
            moved = (f" and were moved to {self.quarantine}. Rerun to start over from step 0, or put an intact copy "
                     f"back into {self.directory} to resume from it." if set_aside else ".")
            raise CheckpointError(f"no intact checkpoint in {self.directory}: steps {tried} are corrupted{moved}")
        return None

    def _quarantine(self, step: int) -> str:
        target = os.path.join(self.quarantine, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        if jax.process_index() == 0:
            os.makedirs(self.quarantine, exist_ok=True)
            shutil.move(os.path.join(self.directory, str(step)), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"quarantine checkpoint {step}")
        self._manager.reload()
        return target

    def close(self) -> None:
        """Waits for pending saves (raising :class:`CheckpointError` if one failed) and releases the manager."""
        try:
            self.wait()
        finally:
            self._manager.close()


class _Corrupt(CheckpointError):
    """One checkpoint is unreadable or does not match its fingerprint."""


def _check_matches(saved: Any, abstract: Any, where: str) -> None:
    try:
        saved_shapes = leaf_shapes(saved)
    except Exception as e:  # noqa: BLE001
        raise _Corrupt(f"checkpoint {where} has unreadable metadata: {_short(e)}") from None
    wanted = leaf_shapes(abstract)
    if saved_shapes != wanted:
        missing = sorted(set(wanted) - set(saved_shapes))
        extra = sorted(set(saved_shapes) - set(wanted))
        differ = sorted(k for k in set(wanted) & set(saved_shapes) if wanted[k] != saved_shapes[k])
        parts = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {extra[:3]}"] if extra else []) + \
                [f"{k}: saved {saved_shapes[k]}, expected {wanted[k]}" for k in differ[:3]]
        raise CheckpointError(f"checkpoint {where} holds a different model or optimizer than this run "
                              f"({'; '.join(parts)}); use another workdir for a different experiment")


def _remedy(error: Exception, directory: str) -> str:
    """What to do about a failed write, by its cause."""
    code, text = getattr(error, "errno", None), str(error)
    if code in (errno.EROFS, errno.EACCES, errno.EPERM) or any(
            s in text for s in ("Read-only file system", "Permission denied", "Operation not permitted")):
        return f"Make {directory} writable again"
    return "Free some space"


def _short(error: Exception) -> str:
    """The error's first line, led by the operating system's reason where one is in it or in
    what caused it (a full disk, a file too large), however deep a library wrapped it."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = text.split(" See full TensorStore details")[0]
    errno = _os_errno(error)
    if errno is not None and os.strerror(errno) not in text[:120]:  # said early enough to survive the cut
        text = f"{os.strerror(errno)} [Errno {errno}]: {text}"
    return text if len(text) <= 300 else text[:300] + " ..."


def _os_errno(error: BaseException) -> int | None:
    """The OS error number in ``error``, its causes, its contexts or grouped errors (None: none)."""
    pending, seen = [error], set()
    while pending:
        e = pending.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e.errno
        found = re.search(r"os_error_code='(\d+)'|\[Errno (\d+)\]", str(e))  # TensorStore's, or wrapped text
        if found:
            return int(found.group(1) or found.group(2))
        pending += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None
