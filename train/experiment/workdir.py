"""A run's workdir belongs to one experiment: the resolved config it records,
and the check that refuses to resume checkpoints of a different one."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import yaml

from train import config as config_lib
from train.experiment.builders import options_from
from train.experiment.names import Resolved
from train.config import ConfigError, ExperimentConfig
from train.config.tracker import TRACKER_KEYS
from train.models import MODELS

__all__ = ["RESUMABLE_CHANGES", "check_writable", "resolved_config", "check_same_experiment", "write_config"]

#: Config keys that may change between a run and its resumption.
RESUMABLE_CHANGES = ("steps", "steps_per_call", "workdir", "compile_cache", "log_every", "eval_every",
                     "checkpoint_every", "keep_checkpoints",
                     "max_nonfinite_steps", "inference_dtypes", "progress", "precision.strict", "data.eval_batch_size",
                     "data.eval_batches", "data.prefetch", "data.path", "mesh.data", "mesh.fsdp", "model.init_from",
                     "mesh.fsdp_min_size", "distributed.coordinator_address", "distributed.num_processes",
                     "distributed.process_id", "distributed.cluster_detect", "distributed.timeout_seconds",
                     *TRACKER_KEYS)


def check_writable(directory: str, key: str, create: bool = True) -> str:
    """``directory`` (made absolute) once a file could be written there, created if
    missing (``create=False``: its nearest existing parent is tried instead, and
    nothing is left behind); else :class:`ConfigError` naming ``key``, the path and
    the cause (a file in the way, a parent that cannot be created, a read-only
    filesystem, no permission)."""
    directory = os.path.abspath(os.path.expanduser(directory))
    existing = directory
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{key}: {existing} is a file, not a directory; give a directory")
    try:
        if create:
            os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory if create else existing, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: {directory} is not writable ({e.strerror or e}); give a directory you can write "
                          f"to") from None
    return directory


def resolved_config(config: ExperimentConfig, model: Any, data: Any, model_name: Resolved) -> dict:
    """The config as plain data, with the model's sizes as built (those taken from the data too).
    ``model_name``: ``model.name`` resolved (:func:`train.experiment.names.resolve_model`)."""
    resolved = config_lib.to_dict(config)
    if model_name.builtin:
        resolved["model"].update({k: list(v) if isinstance(v, tuple) else v for k, v in
                                  ((f, getattr(model, f)) for f in config_lib.model_fields(config.model.name))})
    else:
        resolved["model"].update(options_from(model_name, config.model, data))
    return resolved


def write_config(workdir: str, resolved: dict) -> None:
    """``WORKDIR/config.yaml``: what the run trains."""
    with open(os.path.join(workdir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(resolved, f, sort_keys=False)


def check_same_experiment(workdir: str, resolved: dict) -> None:
    """Raises :class:`ConfigError` when ``workdir`` holds checkpoints of an experiment
    that differs from ``resolved`` in a key outside :data:`RESUMABLE_CHANGES`."""
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
