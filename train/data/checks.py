"""Sanity checks of a built dataset, before anything compiles: data a model cannot
learn from, or a setting the dataset would silently ignore, is one line
(:class:`DataError`, exit status 2), not a run that trains to nothing and exits 0.

* ``data.num_classes`` set while the dataset knows its own classes, and they differ;
* a classifier with fewer than two classes, or training labels all of one class;
* non-finite values (NaN, inf) in any floating array of a split held in memory
  (counted in one pass; an array of more than :data:`MAX_SCANNED` values is
  checked on an evenly spaced sample of its rows, and the message says so);
* eval inputs (or labels) of another kind of dtype than the train split's
  (integers beside floats): the model was built and compiled for the train split's.

Sources and streams are not read here beyond their first example (reading them
is the run's job); non-finite values there stop the run on its non-finite steps.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import numpy as np

from train.data.base import ClassificationData, DataError
from train.data.model_inputs import path_name

__all__ = ["MAX_SCANNED", "check_data"]

#: Values of one array checked for non-finite values in full; a larger array is checked on a sample of
#: its rows about this size (0.1 s of numpy on 2 CPU cores).
MAX_SCANNED = 50_000_000


def check_data(data: Any, data_config: Any = None) -> None:
    """Raises :class:`DataError` (one line naming the split, the key and the numbers)
    for ``data`` no model can learn from, or that contradicts ``data_config``'s
    ``num_classes`` when the config sets it (see the module's docstring)."""
    _check_num_classes_setting(data, data_config)
    _check_classes(data)
    for split, arrays in _splits(data):
        if arrays is not None:
            _check_finite(data.name, split, arrays)
    (train_name, train), (eval_name, evaluation) = _examples(data)
    if train is not None and evaluation is not None:
        _check_dtypes_agree(data.name, train_name, train, eval_name, evaluation)


def _check_num_classes_setting(data: Any, data_config: Any) -> None:
    """``data.num_classes``, when the config sets it, is the dataset's: a shipped dataset
    other than the synthetic ones, and a user's, know their classes and ignore the key."""
    if data_config is None or "num_classes" not in getattr(data_config, "model_fields_set", ()):
        return
    given, known = data_config.num_classes, getattr(data, "num_classes", None)
    if known is None:
        raise DataError(f"data.num_classes: set to {given}, but {data.name} gives no number of classes (its task is "
                        f"not classification); the key is read by the synthetic datasets only: remove it")
    if int(known) != int(given):
        raise DataError(f"data.num_classes: set to {given}, but {data.name} has {known} classes (the key is read by "
                        f"the synthetic datasets only; this dataset knows its own): remove it, or set it to {known}")


def _check_classes(data: Any) -> None:
    """A classifier needs two classes, and training labels of more than one."""
    if getattr(data, "task", None) != "classification":
        return
    classes = getattr(data, "num_classes", None)
    if classes is not None and int(classes) < 2:
        raise DataError(f"{data.name}: num_classes={classes}: a classifier needs at least 2 classes (with one, the "
                        f"loss is 0 whatever the model does, and nothing trains)")
    labels = _train_labels(data)
    if labels is not None and labels.size and np.issubdtype(labels.dtype, np.integer):
        low, high = int(labels.min()), int(labels.max())
        if low == high:
            raise DataError(f"{data.name}: every training label is {low}: with one class among the training labels "
                            f"(of {classes}) there is nothing to learn; check the labels")


def _train_labels(data: Any) -> np.ndarray | None:
    for split, arrays in _splits(data):
        if arrays is not None and split == "train":
            labels = arrays.get("labels")
            return None if labels is None or isinstance(labels, dict) else np.asarray(labels)
    return None


def _splits(data: Any) -> Iterator[tuple[str, dict | None]]:
    """``(split name, its arrays by key)`` of each split; arrays None where the split is not
    held in memory (a source or a stream)."""
    if isinstance(data, ClassificationData):
        yield "train", {"inputs": data.x_train, "labels": data.y_train}
        yield "test", {"inputs": data.x_test, "labels": data.y_test}
        return
    for attr, name in (("train", "train"), ("eval", "eval")):  # a user's data (train.data.user.UserData)
        split = getattr(data, attr, None)
        if split is not None:
            arrays = getattr(split, "arrays", None)
            yield name, arrays if isinstance(arrays, dict) else None


def _examples(data: Any) -> tuple[tuple[str, dict | None], tuple[str, dict | None]]:
    """One example (arrays by key) of the train split and of the eval split, where known."""
    if isinstance(data, ClassificationData):
        return (("train", {"inputs": data.x_train[:1], "labels": data.y_train[:1]}),
                ("test", {"inputs": data.x_test[:1], "labels": data.y_test[:1]}))
    found = []
    for attr in ("train", "eval"):
        example = getattr(getattr(data, attr, None), "example", None)
        found.append((attr, example if isinstance(example, dict) else None))
    return found[0], found[1]


def _leaves(arrays: dict) -> list[tuple[str, Any]]:
    """``(key, array)`` for every array of a split, a model's several inputs named as the user wrote
    them: ``inputs.timesteps`` (a dict of named inputs), ``inputs[1]`` (a tuple)."""
    leaves = jax.tree_util.tree_leaves_with_path(arrays, is_leaf=lambda x: isinstance(x, np.ndarray))
    return [(path_name(path), x) for path, x in leaves]


def _check_finite(name: str, split: str, arrays: dict) -> None:
    """No NaN or inf in a floating array of the split (counted, or on a sample of a huge array's rows)."""
    for key, values in _leaves(arrays):
        values = np.asarray(values)
        if not np.issubdtype(values.dtype, np.inexact) or values.size == 0:
            continue
        sampled = values.size > MAX_SCANNED and len(values) > 1
        if sampled:
            rows = max(1, min(len(values), MAX_SCANNED * len(values) // values.size))
            values = values[np.linspace(0, len(values) - 1, rows).astype(np.int64)]
        bad = values.size - int(np.count_nonzero(np.isfinite(values)))
        if bad:
            nan = int(np.count_nonzero(np.isnan(values)))
            where = (f" of a sample of {len(values):,} evenly spaced examples (the split is too large to scan "
                     f"in full)" if sampled else "")
            values_ = "value" if bad == 1 else "values"
            raise DataError(f"{name}: the {split} split's {key} hold {bad:,} non-finite {values_} ({nan:,} NaN, "
                            f"{bad - nan:,} inf) among {values.size:,}{where}: a model trained or evaluated on them "
                            f"gives a non-finite loss; replace them (e.g. np.nan_to_num) or drop those examples")


def _kind(dtype: np.dtype) -> str:
    if np.issubdtype(dtype, np.bool_):
        return "boolean"
    if np.issubdtype(dtype, np.integer):
        return "integer"
    if np.issubdtype(dtype, np.floating):
        return "floating-point"
    return str(dtype)


def _check_dtypes_agree(name: str, train_name: str, train: dict, eval_name: str, evaluation: dict) -> None:
    """The eval split's arrays are of the train split's kind of dtype (a float16 beside a float32 is fine;
    integers beside floats are not: the model was built for, and computes on, the train split's)."""
    eval_leaves = dict(_leaves(evaluation))
    for key, x in _leaves(train):
        if key not in eval_leaves or not (key in ("inputs", "labels") or key.startswith(("inputs.", "inputs["))):
            continue
        a, b = np.asarray(x).dtype, np.asarray(eval_leaves[key]).dtype
        if _kind(a) != _kind(b):
            raise DataError(f"{name}: the {eval_name} split's {key} are {b} ({_kind(b)}), the {train_name} split's "
                            f"{a} ({_kind(a)}); the model is built and trained for the {train_name} split's and "
                            f"evaluated on the {eval_name} split's, so they must be of one kind: convert the "
                            f"{eval_name} split's to {a}")
