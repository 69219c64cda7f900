"""A model's inputs in a batch: one array, or several, named or in order.

A batch's ``inputs`` entry is what the model is called on:

- an array: ``model(inputs)``;
- a dict of arrays: keyword arguments, ``model(**inputs)`` (a diffusion UNet's
  ``sample``, ``timesteps`` and ``encoder_hidden_states``; an encoder-decoder's
  ``input_ids`` and ``decoder_input_ids``), or the dict whole, ``model(inputs)``
  (a model written ``def __call__(self, batch)`` reading ``batch["image"]``), as
  :func:`inputs_as` decides from the model's signature (``data.inputs_as``,
  ``create_train_state(inputs_as=)``: ``auto``, ``kwargs`` or ``dict``);
- a tuple of arrays: positional arguments, ``model(*inputs)`` (a list is one
  array's rows, as NumPy reads it).

Every array has one row per example. The train and eval steps, the state's
initialisation, ``--explain``, the doctor and ``--compile-for`` all call the
model through :func:`call_arguments`, so a model with several inputs needs no
wrapper.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import numpy as np

__all__ = ["call_arguments", "call_with", "first_input", "path_name", "describe_inputs", "check_input_names",
           "inputs_as", "InputsError", "INPUTS_AS", "RESERVED_NAMES"]

#: How a dict of inputs is passed: decided from the model's signature, as keyword arguments, or whole.
INPUTS_AS = ("auto", "kwargs", "dict")

#: Keywords the framework passes to a model's ``apply`` itself: no input may take these names.
RESERVED_NAMES = frozenset({"rngs", "mutable", "method", "variables", "capture_intermediates", "train",
                            "training", "is_training", "deterministic"})


def call_arguments(inputs: Any, inputs_as: str = "kwargs") -> tuple[tuple, dict]:
    """``(args, kwargs)`` to call a model on ``inputs``: a dict as keyword arguments (or, with
    ``inputs_as="dict"``, as the one positional argument), a tuple as positional ones,
    anything else as the one positional argument."""
    if isinstance(inputs, Mapping):
        return ((inputs,), {}) if inputs_as == "dict" else ((), dict(inputs))
    if isinstance(inputs, tuple):
        return tuple(inputs), {}
    return (inputs,), {}


def call_with(fn: Any, inputs: Any, *leading: Any, inputs_as: str = "kwargs", **keywords: Any) -> Any:
    """``fn(*leading, <inputs>, **keywords)``, the inputs passed as :func:`call_arguments` says
    (``model.init(key, <inputs>, train=False)``, ``model.apply(variables, <inputs>, ...)``)."""
    args, kwargs = call_arguments(inputs, inputs_as)
    return fn(*leading, *args, **kwargs, **keywords)


class InputsError(ValueError):
    """A dict of inputs that the model's signature takes neither as keyword arguments nor
    whole, or both ways: the message names ``inputs_as``'s choices."""


def inputs_as(signature: inspect.Signature | None, inputs: Any, choice: str = "auto", model: str = "model") -> str:
    """``"kwargs"`` or ``"dict"``: how a model (named ``model`` in errors) whose call has
    ``signature`` (``self`` left out; None where it cannot be read) takes ``inputs``, a dict
    of arrays. A ``choice`` other than ``"auto"`` is the answer. Else: keyword arguments
    where every key is a parameter, the dict whole where the call takes one positional input
    and no key is a parameter; anything else raises :class:`InputsError`, one line saying
    why and how to choose."""
    choice = _checked_choice(choice)
    if choice != "auto" or not isinstance(inputs, Mapping):
        return "kwargs" if choice == "auto" else choice
    keys = list(inputs)
    if signature is None:
        raise InputsError(f"inputs {_names(keys)} (a dict) for {model}, whose call's signature cannot be read: "
                          f"{_how(model, keys)}")
    params = [p for p in signature.parameters.values() if p.name not in RESERVED_NAMES]
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    not_kwargs = _not_as_kwargs(params, named, required, keys)
    not_whole = _not_whole(params, named, required, keys)
    if bool(not_kwargs) != bool(not_whole):
        return "dict" if not_kwargs else "kwargs"
    call = f"{model}.__call__{signature}"
    if not_kwargs:
        raise InputsError(f"inputs {_names(keys)} (a dict) fit {call} neither as keyword arguments ({not_kwargs}) "
                          f"nor whole ({not_whole}): rename them to its parameters, or {_how(model, keys)}")
    raise InputsError(f"inputs {_names(keys)} (a dict) fit {call} both as keyword arguments and whole: "
                      f"{_how(model, keys)}")


def _not_as_kwargs(params: list, named: list, required: list, keys: list) -> str:
    """Why ``keys`` cannot be the call's keyword arguments ("" where they can)."""
    unknown = [k for k in keys if k not in named]
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):
        return f"{_names(unknown)} {'is not a parameter' if len(unknown) == 1 else 'are not parameters'}"
    missing = [p.name for p in required if p.name not in keys or p.kind == p.POSITIONAL_ONLY]
    return f"it needs {_names(missing)}" if missing else ""


def _not_whole(params: list, named: list, required: list, keys: list) -> str:
    """Why the dict of ``keys`` cannot be the call's one positional input ("" where it can)."""
    if parameters := [k for k in keys if k in named]:
        return f"{_names(parameters)} {'is a parameter' if len(parameters) == 1 else 'are parameters'}"
    if len(required) > 1 or any(p.kind == p.KEYWORD_ONLY for p in required):
        return f"it needs {_names([p.name for p in required])}"
    if not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params):
        return "it takes no positional input"
    return ""


def _how(model: str, keys: list) -> str:
    """How to choose, in words: the config key and its values, and the Python argument."""
    example = ", ".join(f"{k}=..." for k in keys)
    return (f"set data.inputs_as to kwargs ({model}({example})) or dict ({model}(inputs)); in Python, "
            f"create_train_state(..., inputs_as='kwargs' or 'dict')")


def _names(keys: list) -> str:
    return ", ".join(repr(k) for k in keys)


def _checked_choice(choice: str) -> str:
    if choice not in INPUTS_AS:
        raise InputsError(f"inputs_as={choice!r}; valid: {', '.join(INPUTS_AS)}")
    return choice


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
