"""The types of config values: numbers (YAML 1.1's ``1e-3`` strings accepted),
counts, names of built-ins or references to user code, and the fields of each
built-in model (checked as a schema of their own)."""

import dataclasses
import difflib
import functools
import inspect
import typing
from typing import Annotated, Any, Callable, Literal

import jax.numpy as jnp
import optax
import optax.contrib
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, create_model

from train.config.errors import invalid
from train.data import DATASETS
from train.models import MODELS
from train.references import is_reference

__all__ = ["Optimizer", "Schedule", "InferenceDtype", "OPTIMIZERS", "SCHEDULES", "INFERENCE_DTYPES", "TASKS",
           "CLASS_REFERENCE", "FUNCTION_REFERENCE", "FACTORY_REFERENCE", "Number", "Fraction", "Count", "NonNegative",
           "ModelName", "DataName", "Task", "model_fields", "options_schema", "optax_optimizers", "optax_schedules"]

InferenceDtype = Literal["float16", "bfloat16"]
#: The built-in optimizers and schedules (the config's b1, b2, eps, ... fields apply as they always have);
#: optimizer.name and optimizer.schedule also take any optax one by name, or a factory reference.
OPTIMIZERS = ("adam", "adamw", "sgd", "lion")
SCHEDULES = ("constant", "cosine", "linear")
INFERENCE_DTYPES = typing.get_args(InferenceDtype)
TASKS = ("auto", "classification", "lm", "language_model")  # language_model: an alias of lm

CLASS_REFERENCE = ("class", "package.module:Name / path/to/file.py:Name")
FUNCTION_REFERENCE = ("function", "module:function / path/to/file.py:function")
FACTORY_REFERENCE = ("factory", "path/to/file.py:make / package.module:make")


def _yaml_number(value: Any) -> Any:
    try:  # YAML 1.1 reads 1e-3 (no dot) as a string
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


Number = Annotated[float, BeforeValidator(_yaml_number), Field(allow_inf_nan=False)]  # finite
Fraction = Annotated[Number, Field(ge=0, lt=1)]  # a rate or a decay: [0, 1)
Count = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]


def _named(key: str, kind: str, builtins: Any, reference: tuple[str, str]) -> AfterValidator:
    """Accepts a name in ``builtins`` or a reference; else an error naming the nearest built-in."""
    noun, form = reference

    def check(value: str) -> str:
        if value in builtins or is_reference(value):
            return value
        if ":" in value:
            raise invalid(f"{key}: {value!r} is not a {noun} reference of the form {form}")
        close = difflib.get_close_matches(value, list(builtins), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise invalid(f"{key}: unknown {kind} {value!r}.{hint} Valid: {', '.join(builtins)}, or a {noun} reference "
                       f"{form}")
    return AfterValidator(check)


def _returns(fn: Callable, kind: type) -> bool:
    """Whether ``fn``'s return annotation is ``kind`` (or a subclass), or absent."""
    annotation = inspect.signature(fn).return_annotation
    if annotation is inspect.Signature.empty:
        return True
    if isinstance(annotation, str):
        return kind.__name__ in annotation
    return isinstance(annotation, type) and issubclass(annotation, kind)


def _first_parameter(fn: Callable) -> str | None:
    try:
        return next(iter(inspect.signature(fn).parameters), None)
    except (TypeError, ValueError):
        return None


@functools.cache
def optax_optimizers() -> dict[str, Callable]:
    """The optimizers of optax and optax.contrib, by name: the public functions whose first
    parameter is ``learning_rate`` and that return a GradientTransformation (the ``scale_by_*``
    building blocks left out; a name in both: optax's)."""
    found: dict[str, Callable] = {}
    for module in (optax.contrib, optax):
        for name in dir(module):
            fn = getattr(module, name)
            if (not name.startswith(("_", "scale_by_")) and callable(fn) and not isinstance(fn, type)
                    and _first_parameter(fn) == "learning_rate" and _returns(fn, optax.GradientTransformation)):
                found[name] = fn
    return dict(sorted(found.items()))


@functools.cache
def optax_schedules() -> dict[str, Callable]:
    """The schedules of ``optax.schedules``, by name: its public functions whose name ends in
    ``_schedule`` or ``_decay`` (``join_schedules`` and ``inject_hyperparams`` are no schedules)."""
    return {name: getattr(optax.schedules, name) for name in sorted(dir(optax.schedules))
            if name.endswith(("_schedule", "_decay")) and callable(getattr(optax.schedules, name))}


def _named_or_optax(key: str, kind: str, builtins: tuple[str, ...], catalog: Callable[[], dict]) -> AfterValidator:
    """Accepts a built-in name, an optax one (from ``catalog``) or a factory reference;
    else one line naming the nearest of them."""
    noun, form = FACTORY_REFERENCE

    def check(value: str) -> str:
        if value in builtins or value in catalog() or is_reference(value):
            return value
        if ":" in value:
            raise invalid(f"{key}: {value!r} is not a {noun} reference of the form {form}")
        close = difflib.get_close_matches(value, [*builtins, *catalog()], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise invalid(f"{key}: unknown {kind} {value!r}.{hint} Valid: {', '.join(builtins)}, an optax {kind} "
                      f"({', '.join(n for n in catalog() if n not in builtins)}), or a {noun} {form}")
    return AfterValidator(check)


Optimizer = Annotated[str, _named_or_optax("optimizer.name", "optimizer", OPTIMIZERS, optax_optimizers)]
Schedule = Annotated[str, _named_or_optax("optimizer.schedule", "schedule", SCHEDULES, optax_schedules)]
ModelName = Annotated[str, _named("model.name", "model", MODELS, CLASS_REFERENCE)]
DataName = Annotated[str, _named("data.name", "dataset", DATASETS, FUNCTION_REFERENCE)]
Task = Annotated[str, _named("task", "task", TASKS, ("loss function", FUNCTION_REFERENCE[1])),
                 AfterValidator(lambda task: "lm" if task == "language_model" else task)]


#: Fields of a built-in model no experiment sets: Linen's own, and generation's (``python -m train
#: sample`` clones the model with a decode cache, train.models.kv_cache).
_NOT_CONFIGURED = ("parent", "name", "decode", "kv_store")


def model_fields(name: str) -> dict[str, tuple[Any, Any]]:
    """The configurable fields of built-in model ``name``: ``{field: (type, default)}``."""
    cls = MODELS[name]
    hints = typing.get_type_hints(cls)
    return {f.name: (hints.get(f.name, Any), f.default) for f in dataclasses.fields(cls)
            if f.name not in _NOT_CONFIGURED and f.init}


def _floating_dtype(value: Any) -> Any:
    try:
        ok = value is None or jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise invalid(f"model.dtype: {value!r} is not a floating dtype; valid: float32, bfloat16, float16 (or null)")
    return value


@functools.cache
def options_schema(name: str) -> type[BaseModel]:
    """A pydantic model of ``name`` and the fields of built-in model ``name``."""
    fields: dict[str, Any] = {"name": (str, name)}
    for key, (tp, default) in model_fields(name).items():
        if key == "dtype":
            tp = Annotated[Any, AfterValidator(_floating_dtype)]
        elif tp is float:
            tp = Fraction if key == "dropout" else Number
        fields[key] = (tp, default)
    config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True)
    return create_model(f"{MODELS[name].__name__}Fields", __config__=config, **fields)
