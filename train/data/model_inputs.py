"""A model's inputs in a batch: one array, or several, named or in order.

A batch's ``inputs`` entry is what the model is called on:

- an array: ``model(inputs)``;
- a dict of arrays: keyword arguments, ``model(**inputs)`` (a diffusion UNet's
  ``sample``, ``timesteps`` and ``encoder_hidden_states``; an encoder-decoder's
  ``input_ids`` and ``decoder_input_ids``);
- a tuple of arrays: positional arguments, ``model(*inputs)`` (a list is one
  array's rows, as NumPy reads it).

Every array has one row per example. The train and eval steps, the state's
initialisation, ``--explain``, the doctor and ``--compile-for`` all call the
model through :func:`call_arguments`, so a model with several inputs needs no
wrapper.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["call_arguments", "call_with", "first_input", "path_name", "describe_inputs", "check_input_names", "RESERVED_NAMES"]

#: Keywords the framework passes to a model's ``apply`` itself: no input may take these names.
RESERVED_NAMES = frozenset({"rngs", "mutable", "method", "variables", "capture_intermediates", "train",
                            "training", "is_training", "deterministic"})


def call_arguments(inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` to call a model on ``inputs``: a dict as keyword arguments, a
    tuple as positional ones, anything else as the one positional argument."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return tuple(inputs), {}
    return (inputs,), {}


def call_with(fn: Any, inputs: Any, *leading: Any, **keywords: Any) -> Any:
    """``fn(*leading, <inputs>, **keywords)``, the inputs passed as :func:`call_arguments` says
    (``model.init(key, <inputs>, train=False)``, ``model.apply(variables, <inputs>, ...)``)."""
    args, kwargs = call_arguments(inputs)
    return fn(*leading, *args, **kwargs, **keywords)


def first_input(inputs: Any) -> Any:
    """The first array of ``inputs`` (the first named or positional one), whose shape stands
    for the example's where one shape is asked for (a sequence's length)."""
    args, kwargs = call_arguments(inputs)
    return args[0] if args else next(iter(kwargs.values()), None)


def path_name(path: tuple) -> str:
    """A key path into a batch as the user wrote it: ``inputs``, ``inputs.timesteps`` (a
    named input), ``inputs[1]`` (one in order)."""
    return "".join(f".{k.key}" if hasattr(k, "key") else f"[{getattr(k, 'idx', k)}]" for k in path).lstrip(".")


def describe_inputs(inputs: Any, per_example: bool = True) -> str:
    """``inputs`` in words: ``shape (8, 8, 3)``, or ``sample (8, 8, 3), timesteps ()``
    (per example: the leading batch axis left out)."""
    def shape(x: Any) -> str:
        dims = tuple(np.shape(x))
        return str(dims[1:] if per_example else dims)

    args, kwargs = call_arguments(inputs)
    if not kwargs and len(args) == 1 and not isinstance(inputs, tuple):
        return f"shape {shape(args[0])}"
    parts = [f"[{i}] {shape(a)}" for i, a in enumerate(args)] + [f"{k} {shape(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def check_input_names(inputs: Any, where: str) -> None:
    """Raises ``ValueError`` (naming ``where``) where a named input takes a keyword the
    framework passes to the model itself (``rngs``, ``train``...)."""
    if not isinstance(inputs, Mapping):
        return
    reserved = sorted(set(inputs) & RESERVED_NAMES)
    if reserved:
        raise ValueError(f"{where}: input {reserved[0]!r} has a name the framework passes to the model itself "
                         f"({', '.join(sorted(RESERVED_NAMES))}); rename it")
