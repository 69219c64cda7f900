"""Start from pretrained weights: ``model.init_from: DIR``, ``create_train_state(..., init_from=DIR)``.

DIR is one of:

* a run of this framework: its workdir, its ``checkpoints/`` or one step's directory (the
  newest step when there are several). Its params are read, as float32 masters where that
  run kept them in the optimizer state (a policy storing params in half precision, e.g.
  ``O2``), and the model's other collections (``batch_stats``); never its optimizer state,
  step, RNG or FP8 amax histories. Read with orbax from the checkpoint's own metadata, only
  the arrays wanted: no template of the other run is needed;
* a Hugging Face Flax ``save_pretrained`` directory (:func:`train.weights.huggingface.read_weights`).
* an export of a run (``python -m train export``: ``params.safetensors``, every collection;
  :func:`train.weights.export.read_export`).

The weights are matched to the model's variables by path and shape. The checkpoint's tree
may sit under a prefix of the model's (a Hugging Face module wrapped by a module of yours)
or the model's under a prefix of the checkpoint's (an LM head model's checkpoint loaded
into its base model), when one alignment matches the most arrays. A shape that differs is
an error; the model's params the checkpoint lacks (a new classification head) keep their
fresh init, and they and the checkpoint's unused arrays are each named in one line (a
warning of the ``train.weights.pretrained`` logger, as Hugging Face's "newly initialized" one). The
train state then casts the params to the policy's param dtypes, with float32 masters, as for
``create_train_state(variables=...)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import precision
from train.finetune.lora import ADAPTER_SUFFIXES
from train.weights.export import PARAMS_FILE, ExportError, dequantized_base, read_export
from train.weights.huggingface import WEIGHT_FILES, read_weights
from train.weights.int8 import dequantized_channels

__all__ = ["PretrainedError", "checkpoint_steps", "describe_init", "find_pretrained",
           "load_pretrained", "pretrained_variables"]

Path = tuple[str, ...]
#: Where params that start from their fresh init, and checkpoint arrays the model does not use, are named.
log = logging.getLogger(__name__)


class PretrainedError(ValueError):
    """``init_from`` cannot be used: missing, unreadable, or not this model's weights (one line)."""


def checkpoint_steps(directory: str) -> list[int]:
    """Steps of the complete orbax checkpoints in ``directory`` (``<step>/state``), oldest first."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory)
                  if n.isdigit() and os.path.isdir(os.path.join(directory, n, "state")))


def find_pretrained(init_from: str | os.PathLike) -> tuple[str, str, int | None]:
    """``(kind, path, step)``: what ``init_from`` holds, without reading it: ``("orbax",
    STEP_DIR/state, step)``, ``("export", DIR, None)`` (``python -m train export``'s
    ``params.safetensors``) or ``("huggingface", DIR, None)``.

    Raises:
      PretrainedError: it does not exist or holds neither (saying what was looked for).
    """
    directory = os.path.abspath(os.path.expanduser(os.fspath(init_from)))
    looked = (f"looked for an orbax checkpoint of this framework ({directory}/checkpoints/<step>/state, "
              f"<step>/state or state) and Hugging Face Flax weights ({', '.join(WEIGHT_FILES[::2])})")
    if not os.path.isdir(directory):
        what = "is a file, not a directory" if os.path.exists(directory) else "does not exist"
        raise PretrainedError(f"init_from: {directory} {what}; {looked}")
    for checkpoints in (os.path.join(directory, "checkpoints"), directory):
        steps = checkpoint_steps(checkpoints)
        if steps:
            return "orbax", os.path.join(checkpoints, str(steps[-1]), "state"), steps[-1]
    if os.path.isdir(os.path.join(directory, "state")):
        name = os.path.basename(directory)
        return "orbax", os.path.join(directory, "state"), int(name) if name.isdigit() else None
    if os.path.isfile(os.path.join(directory, PARAMS_FILE)):  # written by python -m train export
        return "export", directory, None
    if any(os.path.isfile(os.path.join(directory, n)) for n in (*WEIGHT_FILES, "config.json", "pytorch_model.bin")):
        return "huggingface", directory, None
    raise PretrainedError(f"init_from: {directory} holds no weights; {looked}")


def describe_init(init_from: str | os.PathLike | None, resuming: bool) -> str:
    """What a run's header says of ``init_from``: where its params come from, or that it is ignored."""
    if init_from is None:
        return ""
    if resuming:
        return f"; resuming, so model.init_from ({init_from}) is ignored"
    kind, path, step = find_pretrained(init_from)
    if kind == "orbax":
        return f"; params from the checkpoint at step {step} in {os.path.dirname(os.path.dirname(path))}"
    return f"; params from the {'exported' if kind == 'export' else 'Hugging Face'} weights in {path}"


def load_pretrained(init_from: str | os.PathLike) -> tuple[dict, str]:
    """``(variables, source)``: the weights ``init_from`` holds as nested dicts of
    numpy arrays, ``{"params": ..., "batch_stats": ...}`` (params float32), and a
    description of where they were read.

    Raises:
      PretrainedError: ``init_from`` is missing, unreadable or holds no weights.
    """
    kind, path, step = find_pretrained(init_from)
    if kind == "orbax":
        variables, source = _read_orbax(path), f"the checkpoint {os.path.dirname(path)}"
    elif kind == "export":
        try:
            variables, file = read_export(path)
        except ExportError as e:
            raise PretrainedError(f"init_from: {e}") from None
        source = f"the exported weights {file}"
    else:
        try:
            found = read_weights(path)
        except ValueError as e:
            raise PretrainedError(f"init_from: {e}") from None
        if found is None:
            raise PretrainedError(f"init_from: {path} has a config.json but no weights ({', '.join(WEIGHT_FILES)})")
        variables, file = found
        source = f"the Hugging Face weights {file}"
    flat = dequantized_channels(traverse_util.flatten_dict(variables.get("params", {})))  # an int8 export's
    params = {k: _as_float32(v) for k, v in flat.items()}
    return {**variables, "params": traverse_util.unflatten_dict(params)}, source


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """orbax logs warnings (missing optional metadata) on reads that are fine: not for the terminal."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _read_orbax(path: str) -> dict:
    """Params (float32 masters where the optimizer state has them) and model state of
    the checkpoint item at ``path``, read through its own metadata: only those arrays."""
    import orbax.checkpoint as ocp

    try:
        with _quiet_orbax(), ocp.PyTreeCheckpointer() as checkpointer:
            saved = checkpointer.metadata(path)
            saved = getattr(saved, "item_metadata", saved)
            saved = getattr(saved, "tree", saved)
            if not isinstance(saved, dict) or "params" not in saved:
                raise PretrainedError(f"init_from: {path} is not a checkpoint of this framework (no params in it)")
            masters = _masters_path(saved.get("opt_state"), ("opt_state",))
            # a fine-tuning's frozen params have no masters (None in their place): those are read from params
            partial = masters is not None and _has_none(_at(saved, masters))
            wanted = {("params",) if masters is None or partial else masters, ("model_state",)}
            if partial:
                wanted.add(masters)
            item = _only(saved, wanted, ocp.PLACEHOLDER)
            restore_args = _map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
            restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
    except PretrainedError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is reported the same way
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PretrainedError(f"init_from: the checkpoint {path} cannot be read ({text[:300]})") from None
    params = _at(restored, ("params",) if masters is None else masters)
    if partial:
        params = _overlay(params, restored["params"])
    state = {k: v for k, v in (restored.get("model_state") or {}).items() if k != precision.FP8_COLLECTION}
    return {"params": params, **state}


def _masters_path(tree: Any, path: Path) -> Path | None:
    """Where a saved optimizer state keeps float32 masters: a mixed-precision state's
    ``master_params`` (saved as a mapping), when the run had them; None otherwise."""
    if isinstance(tree, dict):
        if {"master_params", "loss_scale", "inner_state"} <= set(tree):
            return path + ("master_params",) if tree["master_params"] else None
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return None
    for key, value in items:
        found = _masters_path(value, path + (key,))
        if found is not None:
            return found
    return None


def _has_none(tree: Any) -> bool:
    """Whether a saved tree has a None leaf (a frozen param's place in the masters)."""
    if isinstance(tree, dict):
        return any(_has_none(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_none(v) for v in tree)
    return tree is None


def _overlay(masters: Any, params: Any) -> Any:
    """``params`` with the masters in the place of each param that has one."""
    if masters is None:
        return params
    if isinstance(params, dict) and isinstance(masters, dict):
        return {k: _overlay(masters.get(k), v) for k, v in params.items()}
    return masters


def _only(tree: Any, wanted: set[Path], placeholder: Any, path: Path = ()) -> Any:
    """``tree`` with the leaves outside the subtrees at ``wanted`` paths replaced by ``placeholder``."""
    if path in wanted:
        return tree
    if isinstance(tree, dict):
        return {k: _only(v, wanted, placeholder, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_only(v, wanted, placeholder, path + (i,)) for i, v in enumerate(tree)]
    return None if tree is None else placeholder


def _map(fn: Callable, tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(fn, v) for v in tree]
    return None if tree is None else fn(tree)


def _at(tree: Any, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _as_float32(x: Any) -> np.ndarray:
    """A floating array as float32 (bfloat16 and float16 widen exactly), others as they are."""
    x = np.asarray(x)
    return x.astype(np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _name(collection: str, path: Path) -> str:
    return "/".join((collection, *map(str, path)))


def pretrained_variables(init_from: str | os.PathLike, expected: dict, fresh: Callable[[], dict]) -> dict:
    """The variables a model starts from: those of ``init_from`` matched to the
    model's (``expected``, abstract: its ``init``'s shapes) by path and shape,
    the rest from ``fresh()`` (the model's own init, called only if needed).
    The FP8 collection is left out (it starts empty).

    Raises:
      PretrainedError: ``init_from`` cannot be read, matches none of the model's
        params or matches them in two ways, or holds an array of another shape.
    """
    loaded, source = load_pretrained(init_from)
    want = {c: traverse_util.flatten_dict(dict(v)) for c, v in expected.items() if c != precision.FP8_COLLECTION}
    have = {c: traverse_util.flatten_dict(dict(v)) for c, v in loaded.items()}
    if "params" in have and "params" in want:  # a fine-tuning's frozen base saved in 8/4-bit codes: read back
        try:
            have["params"] = dequantized_base(have["params"], {p: tuple(s.shape) for p, s in want["params"].items()})
        except ExportError as e:
            raise PretrainedError(f"init_from: {source}: {e}") from None
    model_prefix, saved_prefix = _alignment(set(want.get("params", {})), set(have.get("params", {})), source)
    out: dict = {c: {} for c in want}
    new, used = [], set()
    for collection, leaves in want.items():
        for path, spec in leaves.items():
            key = saved_prefix + path[len(model_prefix):] if path[:len(model_prefix)] == model_prefix else None
            value = have.get(collection, {}).get(key) if key is not None else None
            if value is None:
                new.append((collection, path))
                continue
            if tuple(np.shape(value)) != tuple(spec.shape):
                raise PretrainedError(f"init_from: {_name(collection, path)} has shape {tuple(spec.shape)} in the "
                                      f"model and {tuple(np.shape(value))} in {source}"
                                      + (f" (at {_name(collection, key)})" if key != path else ""))
            used.add((collection, key))
            out[collection][path] = value if collection == "params" else np.asarray(value).astype(spec.dtype)
    if new:
        initial = {c: traverse_util.flatten_dict(dict(v)) for c, v in fresh().items()}
        for collection, path in new:
            out[collection][path] = initial[collection][path]
        # LoRA's adapters are new by design (B starts at zero: the adapted model is the base); not worth a warning
        new = [(c, p) for c, p in new if not str(p[-1]).endswith(ADAPTER_SUFFIXES)]
        if new:
            _report(new, f"of the model are not in {source} and start from their fresh init")
    unused = [(c, p) for c, leaves in have.items() for p in leaves if (c, p) not in used]
    if unused:
        _report(unused, f"of {source} are not used by the model")
    return {c: traverse_util.unflatten_dict(v) for c, v in out.items() if v or c == "params"}


def _report(paths: list[tuple[str, Path]], what: str) -> None:
    """One warning line: how many arrays, what of them, the first few paths."""
    names = [_name(c, p) for c, p in paths]
    more = f", ... ({len(names) - 5} more)" if len(names) > 5 else ""
    log.warning("init_from: %d array%s %s: %s%s", len(names), "s" if len(names) > 1 else "", what,
                ", ".join(names[:5]), more)


def _alignment(model: set[Path], saved: set[Path], source: str) -> tuple[Path, Path]:
    """``(model_prefix, saved_prefix)``, one of them empty: the model's path ``model_prefix + p``
    is the checkpoint's ``saved_prefix + p``. The one matching the most arrays, exact paths
    first on a tie; two others that tie are an error, as is one matching nothing."""
    counts: dict[tuple[Path, Path], int] = {((), ()): len(model & saved)}
    for paths, others, side in ((model, saved, 0), (saved, model, 1)):
        for path in paths:
            for k in range(1, len(path)):
                if path[k:] in others:
                    key = (path[:k], ()) if side == 0 else ((), path[:k])
                    counts[key] = counts.get(key, 0) + 1
    best = max(counts.values())
    if best == 0:
        raise PretrainedError(f"init_from: none of the model's {len(model)} params is in {source}: the model has "
                              f"{_examples(model)}, the checkpoint {_examples(saved)}")
    tied = sorted(k for k, n in counts.items() if n == best)
    if len(tied) > 1 and ((), ()) not in tied:
        a, b = (f" under {'/'.join(m or s)} of the {'model' if m else 'checkpoint'}" for m, s in tied[:2])
        raise PretrainedError(f"init_from: the params of {source} match the model's in two ways ({best} arrays "
                              f"each:{a};{b}); give a checkpoint of this model's part")
    return ((), ()) if ((), ()) in tied else tied[0]


def _examples(paths: set[Path]) -> str:
    names = sorted("/".join(map(str, p)) for p in paths)
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") if names else "no params"
