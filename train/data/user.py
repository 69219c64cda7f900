"""A user's own data, named in a config as ``data.name: module:function``.

The function (called with ``data.options`` as keyword arguments) returns one of:

* ``{"train": split, "eval": split}`` (``"test"`` / ``"validation"`` also name
  the eval split), each split one of

  - a dict of arrays with one row per example (``inputs`` required,
    ``labels`` for the built-in tasks, any other keys passed to a user's loss);
    a model with several inputs takes ``inputs`` as a dict of arrays (keyword
    arguments: ``{"sample": ..., "timesteps": ...}``) or a tuple (positional),
    see :mod:`train.data.model_inputs`;
  - a random-access source (``len(source)`` and ``source[i]`` giving one
    example as a dict of arrays, as grain's ``MapDataSource`` / ``MapDataset``
    or a Hugging Face dataset does);
  - an iterable of examples (a generator, an iterator, a ``grain.IterDataset``,
    any object with ``__iter__``): a stream, see :mod:`train.data.stream`. For
    eval it must be finite; a one-shot iterator is read once, at the first
    evaluation (up to ``data.eval_batches`` batches), and kept.

  Optional keys: ``num_classes`` (required with a source or a stream for the
  built-in tasks), ``task`` (``classification`` / ``language_model``), ``name``.
* an object with the dataset protocol of :mod:`train.data.base` (``name``,
  ``task``, ``num_classes``, ``input_shape``, ``describe()``,
  ``sample_input(n)``, ``train_batch(index, batch_size, seed, rows)``,
  ``eval_batches(batch_size, max_batches)``).

Arrays and sources get the shipped datasets' shuffling (grain's, per epoch),
batching, per-process rows and exact resume: batch ``i`` is a pure function of
``(seed, i)``. A stream is read in its own order, batch ``i`` the next examples;
a resumed run continues it at the same example (grain's iterator state, or a
replay). In a multi-process run every process reads the global batch and keeps
its rows; a function that takes ``process_index`` and ``process_count`` keyword
arguments gets them, and its train split is then that process's own share (each
batch takes this process's rows' worth from it); the eval split stays the whole
eval set on every process.
"""

from __future__ import annotations

from typing import Any, Iterator

import inspect

import jax
import numpy as np

from train.data.base import Batch, DataError, EpochOrder, padded_batches
from train.data.stream import EvalStream, TrainStream, is_stream, stack_examples
from train.data.model_inputs import check_input_names, describe_inputs, first_input, path_name
from train.references import one_line

__all__ = ["UserData", "from_user_function"]

_EVAL_KEYS = ("eval", "test", "validation")
_PROTOCOL = ("name", "task", "num_classes", "input_shape", "describe", "sample_input", "train_batch", "eval_batches")


class _Split:
    """One split, arrays or a random-access source, read by example indices."""

    def __init__(self, split: Any, where: str):
        self.where = where
        if isinstance(split, dict):
            arrays = {k: _arrays(v, f"{where}: {k!r}") for k, v in split.items()}
            sizes = {path_name(path): (len(v) if v.ndim else None)
                     for path, v in jax.tree_util.tree_leaves_with_path(arrays)}
            if len(set(sizes.values())) != 1 or None in sizes.values():
                raise DataError(f"{where}: every array needs one row per example; got rows {sizes}")
            self.arrays, self.source, self.size = arrays, None, next(iter(sizes.values()))
        elif hasattr(split, "__len__") and hasattr(split, "__getitem__"):
            self.arrays, self.source, self.size = None, split, len(split)
        else:
            raise DataError(f"{where}: expected a dict of arrays, a source with len() and [i], or an iterable of "
                            f"examples, got {type(split).__name__}")
        if self.size == 0:
            raise DataError(f"{where}: no examples")
        first = self.take(np.arange(1))
        if "inputs" not in first:
            raise DataError(f"{where}: examples need an 'inputs' entry (the model's input); got keys "
                            f"{sorted(first)}")
        self.example = jax.tree_util.tree_map(lambda v: v[0], first)

    def take(self, indices: np.ndarray) -> Batch:
        if self.arrays is not None:
            return jax.tree_util.tree_map(lambda v: v[indices], self.arrays)
        return stack_examples([self.source[int(i)] for i in indices], self.where)

    def describe(self) -> str:
        return str(self.size)


def _arrays(values: Any, where: str) -> Any:
    """``values`` as arrays with one row per example: one array, or a dict or tuple of them
    (a model's several inputs, :mod:`train.data.model_inputs`)."""
    if isinstance(values, dict):
        return {k: _arrays(v, f"{where}[{k!r}]") for k, v in values.items()}
    if isinstance(values, tuple):
        return tuple(_arrays(v, f"{where}[{i}]") for i, v in enumerate(values))
    return _rows(values, where)


def _rows(values: Any, where: str) -> np.ndarray:
    """``values`` as an array with one row per example; ragged rows are an error."""
    try:
        return np.asarray(values)
    except ValueError:
        lengths = sorted({np.shape(v) for v in values}, key=str)[:4] if hasattr(values, "__iter__") else []
        raise DataError(f"{where} rows differ in shape (e.g. {', '.join(map(str, lengths))}): pad or crop them to "
                        f"one shape") from None


def _check_splits_agree(train: "_Split", evaluation: "_Split", name: str) -> None:
    """The eval examples have the train examples' keys' shapes (the model takes both)."""
    for key in ("inputs", "labels"):
        if key in train.example and key in evaluation.example:
            a = dict(jax.tree_util.tree_leaves_with_path({key: train.example[key]}))
            b = dict(jax.tree_util.tree_leaves_with_path({key: evaluation.example[key]}))
            for path in sorted(set(a) | set(b), key=path_name):
                if path not in a or path not in b:
                    split = "train" if path not in a else "eval"
                    raise DataError(f"{name}: the {split} split has no {path_name(path)}, the other has; the model "
                                    f"takes both splits, so their inputs must agree")
                if np.shape(a[path]) != np.shape(b[path]):
                    raise DataError(f"{name}: the eval split's {path_name(path)} have shape {np.shape(b[path])}, the "
                                    f"train split's {np.shape(a[path])}; the model takes both, so they must agree")


def _check_labels(splits: tuple["_Split", ...], num_classes: int, name: str) -> None:
    """Integer labels in ``[0, num_classes)`` (of arrays: all; of a source: its first example)."""
    for split in splits:
        labels = split.arrays["labels"] if split.arrays is not None else np.asarray(split.example["labels"])
        if labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
            continue
        low, high = int(np.min(labels)), int(np.max(labels))
        if low < 0 or high >= num_classes:
            bad = low if low < 0 else high
            raise DataError(f"{split.where}: label {bad} is outside [0, {num_classes}) for num_classes={num_classes}; "
                            f"labels must be class indices")


def _whole_number_of_classes(num_classes: Any, name: str) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise DataError(f"{name}: num_classes must be a whole number (how many classes), got {num_classes!r}")
    return int(num_classes)


def _check_one_class(split: "_Split", num_classes: int, task: str, name: str) -> None:
    """At least 2 classes, and training labels of a classifier not all one class: with
    one, the loss is 0 (or the labels constant) whatever the model does."""
    if num_classes < 2:
        raise DataError(f"{name}: num_classes={num_classes}: a classifier needs at least 2 classes (with one, the "
                        f"loss is 0 whatever the model does, and nothing trains)")
    if task != "classification" or split.arrays is None or "labels" not in split.arrays:
        return
    classes = np.unique(split.arrays["labels"])
    if classes.size == 1:
        raise DataError(f"{split.where}: every label is {int(classes[0])}: with one class among the training "
                        f"labels (of {num_classes}) there is nothing to learn; check the labels you return")


def _check_inputs(split: "_Split") -> None:
    """Real-valued (or integer) inputs: complex numbers are no model's input here."""
    for path, value in jax.tree_util.tree_leaves_with_path({"inputs": split.example["inputs"]}):
        what, dtype = path_name(path), np.asarray(value).dtype
        if np.issubdtype(dtype, np.complexfloating):
            raise DataError(f"{split.where}: {what} are complex ({dtype}); models train on real numbers: pass the "
                            f"real and imaginary parts as features (e.g. np.stack([x.real, x.imag], -1))")
        if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
            raise DataError(f"{split.where}: {what} of dtype {dtype} are not numbers; convert them to arrays of "
                            f"numbers")
    try:
        check_input_names(split.example["inputs"], split.where)
    except ValueError as e:
        raise DataError(str(e)) from None


class UserData:
    """Train and eval splits of a user's data: arrays and random-access sources with the
    shipped datasets' batching, streams read in order (:mod:`train.data.stream`).
    ``sharded``: the train split is this process's own share of the data."""

    def __init__(self, name: str, train: Any, evaluation: Any, num_classes: int | None = None,
                 task: str | None = None, sharded: bool = False):
        self.name, self.sharded = name, sharded
        self.train = TrainStream(train, f"{name}: train split", sharded) if is_stream(train) else \
            _Split(train, f"{name}: train split")
        self.eval = EvalStream(evaluation, f"{name}: eval split") if is_stream(evaluation) else \
            _Split(evaluation, f"{name}: eval split")
        self._order = None if isinstance(self.train, TrainStream) else EpochOrder(self.train.size, name)
        _check_splits_agree(self.train, self.eval, name)
        _check_inputs(self.train)
        self.task = task or _infer_task(self.train.example)
        if num_classes is None and self.task is not None:
            splits = (self.train.arrays, self.eval.arrays)
            if any(arrays is None or "labels" not in arrays for arrays in splits):
                raise DataError(f"{name}: give num_classes with a {self.task} source or stream (sources and "
                                f"streams are not scanned for their largest label)")
            num_classes = int(max(np.max(arrays["labels"]) for arrays in splits)) + 1
        if num_classes is not None:
            num_classes = _whole_number_of_classes(num_classes, name)
        if num_classes is not None and self.task is not None:
            _check_labels((self.train, self.eval), num_classes, name)
            _check_one_class(self.train, num_classes, self.task, name)
        self.num_classes = num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one example's input (of several: the first's)."""
        return tuple(np.shape(first_input(self.train.example["inputs"])))

    def describe(self) -> str:
        classes = f", {self.num_classes} classes" if self.num_classes else ""
        inputs = describe_inputs(self.train.example["inputs"], per_example=False)
        return f"{self.name}: {self.train.describe()} train / {self.eval.describe()} eval examples of {inputs}{classes}"

    def sample_input(self, batch_size: int = 1) -> np.ndarray:
        return self.sample_batch(batch_size)["inputs"]

    def sample_batch(self, batch_size: int = 1) -> Batch:
        """The first ``batch_size`` training examples (repeated if there are fewer)."""
        if isinstance(self.train, TrainStream):
            return self.train.head(batch_size)
        return self.train.take(np.arange(batch_size) % self.train.size)

    def train_batch(self, index: int, batch_size: int, seed: int, rows: slice = slice(None)) -> Batch:
        """Batch ``index`` (``rows`` of it): of endless epochs of fresh permutations, or
        the next examples of a stream."""
        if isinstance(self.train, TrainStream):
            return self.train.batch(index, batch_size, rows)
        return self.train.take(self._indices(index, 1, batch_size, seed, rows)[0])

    def train_batch_stack(self, first: int, count: int, batch_size: int, seed: int,
                          rows: slice = slice(None)) -> Batch:
        """Batches ``first .. first + count - 1`` stacked (leading axis ``count``), in one read."""
        if isinstance(self.train, TrainStream):
            return self.train.batch_stack(first, count, batch_size, rows)
        idx = self._indices(first, count, batch_size, seed, rows)
        return jax.tree_util.tree_map(lambda v: v.reshape(idx.shape + v.shape[1:]), self.train.take(idx.ravel()))

    def _indices(self, first: int, count: int, batch_size: int, seed: int, rows: slice) -> np.ndarray:
        """Example indices of ``count`` batches; of a process's own share, its rows' worth each."""
        if self.sharded:
            batch_size, rows = len(range(*rows.indices(batch_size))), slice(None)
        return self._order.stacked_indices(first, count, batch_size, seed, rows)

    def eval_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[Batch]:
        """The eval split in order, the last batch padded (``mask`` marks real examples)."""
        if isinstance(self.eval, EvalStream):
            yield from self.eval.batches(batch_size, max_batches)
        else:
            yield from padded_batches(self.eval.size, self.eval.take, batch_size, max_batches)

    def checkpoint_state(self, step: int) -> dict | None:
        """What a checkpoint at ``step`` records of the data position beyond the step: a
        stream's examples read and iterator state (None for arrays and sources)."""
        return self.train.checkpoint_state(step) if isinstance(self.train, TrainStream) else None

    def resume(self, step: int, saved: dict | None) -> str | None:
        """Continues a stream where the checkpoint at ``step`` left it; a line saying how."""
        return self.train.resume(step, saved) if isinstance(self.train, TrainStream) else None


def _infer_task(example: dict) -> str | None:
    labels, inputs = example.get("labels"), np.asarray(first_input(example["inputs"]))
    if labels is None or not np.issubdtype(np.asarray(labels).dtype, np.integer):
        return None
    labels = np.asarray(labels)
    if labels.ndim == 0:
        return "classification"
    if labels.shape == inputs.shape and np.issubdtype(inputs.dtype, np.integer):
        return "language_model"
    return None


def from_user_function(fn: Any, options: dict, key: str = "data.name") -> Any:
    """Calls a user's data function with ``options`` and wraps what it returns."""
    name = getattr(fn, "__name__", "user data")
    sharded = _takes_process_arguments(fn)
    if sharded:
        given = sorted(set(options) & {"process_index", "process_count"})
        if given:
            raise DataError(f"data.options.{given[0]}: set by the run (this process's index and the process count) "
                            f"for a function that takes it; remove it from data.options")
        options = dict(options, process_index=jax.process_index(), process_count=jax.process_count())
    try:
        result = fn(**options)
    except Exception as e:  # noqa: BLE001 - the user's function raised
        raise DataError(f"{key}: calling {name}(**data.options) failed: {one_line(e)}") from None
    if all(hasattr(result, attr) for attr in _PROTOCOL):
        return result
    if not isinstance(result, dict) or "train" not in result:
        missing = [a for a in _PROTOCOL if not hasattr(result, a)]
        raise DataError(f"{key}: {name} must return {{'train': ..., 'eval': ...}} (dicts of arrays, random-access "
                        f"sources or iterables of examples) or a dataset object; got {type(result).__name__} "
                        f"(missing {', '.join(missing)})")
    eval_key = next((k for k in _EVAL_KEYS if k in result), None)
    if eval_key is None:
        raise DataError(f"{key}: {name} returned no eval split; add one of {', '.join(_EVAL_KEYS)}")
    unknown = set(result) - {"train", *_EVAL_KEYS, "num_classes", "task", "name"}
    if unknown:
        raise DataError(f"{key}: {name} returned unknown keys {sorted(unknown)}; valid: train, "
                        f"{', '.join(_EVAL_KEYS)}, num_classes, task, name")
    return UserData(result.get("name", name), result["train"], result[eval_key], result.get("num_classes"),
                    result.get("task"), sharded)


def _takes_process_arguments(fn: Any) -> bool:
    """Whether ``fn`` names ``process_index`` and ``process_count`` parameters (then it
    returns this process's share of the training data)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return {"process_index", "process_count"} <= set(parameters)
