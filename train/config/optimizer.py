"""The ``optimizer`` section: the optimizer (a built-in, any optax optimizer by name, or
the user's factory) and the learning-rate schedule (likewise), and the keyword
arguments the config gives each, checked against its signature.

What an optimizer function gets:

- the built-ins (adam, adamw, sgd, lion): the ``b1``, ``b2``, ``eps``,
  ``weight_decay``, ``momentum``, ``nesterov`` fields, as always, and ``options``;
- any other: ``options``, plus those of these fields that were set explicitly
  (``weight_decay`` also as adafactor's ``weight_decay_rate``); a field set for a
  function that does not take it is an error (a ``weight_decay`` of 0 excepted:
  nothing to apply), and ``optimizer.weight_decay=null`` unsets what a file set (as
  ``null`` does for every field: see :mod:`train.config.section`). ``learning_rate``:
  the schedule, when the function takes it.

What a schedule function gets (optax's, or a factory's): ``schedule_options``, plus,
for each of these arguments it takes and the options do not give:
``value``/``peak_value``/``lr``/``learning_rate`` ← lr; ``init_value`` ← lr, or 0
when it also takes ``peak_value`` (it rises to the peak); ``warmup_steps`` ←
warmup_steps (the schedule then warms up itself, nothing is joined in front);
``decay_steps``/``steps`` ← the steps it spans (all, with its own warmup; else those
after the warmup); ``transition_steps`` ← the steps after the warmup;
``end_value``/``min_lr``/``alpha`` ← min_lr (alpha: min_lr / lr), when min_lr is set
or the argument has no default.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable

from pydantic import Field, model_serializer, model_validator

from train.config.errors import ConfigError, invalid
from train.config.section import Section
from train.config.fields import (FACTORY_REFERENCE, OPTIMIZERS, SCHEDULES, Fraction, NonNegative, Number, Optimizer,
                                 Schedule, optax_optimizers, optax_schedules)
from train.references import is_reference

__all__ = ["OptimizerConfig", "FIELD_ARGUMENTS", "SCHEDULE_FIELDS", "optax_function", "optimizer_arguments",
           "schedule_arguments", "parameters", "takes"]

#: The optimizer fields passed, when set, to optimizers other than the built-ins: field -> argument names.
FIELD_ARGUMENTS = {"b1": ("b1",), "b2": ("b2",), "eps": ("eps",), "weight_decay": ("weight_decay", "weight_decay_rate"),
                   "momentum": ("momentum",), "nesterov": ("nesterov",)}
#: The fields that make the learning rate (unused by a factory that takes no learning_rate).
SCHEDULE_FIELDS = ("lr", "schedule", "schedule_options", "warmup_steps", "min_lr")
#: The arguments of the built-ins' optax functions that the fields fill.
_BUILTIN_FILLS = {"adam": ("b1", "b2", "eps"), "adamw": ("b1", "b2", "eps", "weight_decay"),
                  "lion": ("b1", "b2", "weight_decay"), "sgd": ("momentum", "nesterov")}


class OptimizerConfig(Section):
    """The optimizer and its learning-rate schedule (see the module's docstring)."""

    dotted_key = "optimizer"

    name: Optimizer = Field("adamw", description=f"optimizer: {', '.join(OPTIMIZERS)}, any optax optimizer by name "
                                                 f"(lamb, adafactor, lars, rmsprop, optax.contrib's muon, ...), or a "
                                                 f"factory {FACTORY_REFERENCE[1]} returning an optax "
                                                 f"GradientTransformation")
    lr: Number = Field(1e-3, gt=0, description="peak learning rate")
    schedule: Schedule = Field("constant", description=f"learning-rate schedule after warmup: {', '.join(SCHEDULES)}, "
                                                       f"any optax schedule by name (warmup_cosine_decay_schedule, "
                                                       f"exponential_decay, ...), or a factory "
                                                       f"{FACTORY_REFERENCE[1]} returning step -> learning rate")
    schedule_options: dict[str, Any] = Field({}, description="keyword arguments of an optax schedule or a schedule "
                                                             "factory (init_value/peak_value, decay_steps, end_value, "
                                                             "warmup_steps default to lr, steps, min_lr, warmup_steps)")
    warmup_steps: NonNegative = Field(0, description="linear warmup from 0 over this many steps (a schedule with "
                                                     "its own warmup_steps argument gets it instead)")
    min_lr: Number = Field(0.0, ge=0, description="final learning rate of the cosine and linear schedules (and an "
                                                  "optax schedule's end_value)")
    weight_decay: Number = Field(0.0, ge=0, description="decoupled weight decay (adamw, lion, sgd; others: when set)")
    b1: Fraction = Field(0.9, description="first-moment decay, in [0, 1) (adam, adamw, lion; others: when set)")
    b2: Fraction = Field(0.999, description="second-moment decay, in [0, 1) (adam, adamw, lion; others: when set)")
    eps: Number = Field(1e-8, gt=0, description="denominator epsilon (adam, adamw; others: when set)")
    momentum: Fraction = Field(0.9, description="momentum, in [0, 1) (sgd; 0 for none; others: when set)")
    nesterov: bool = Field(False, description="Nesterov momentum (sgd; others: when set)")
    options: dict[str, Any] = Field({}, description="keyword arguments of the optimizer function (optax's or the "
                                                    "factory's), e.g. {decay_rate: 0.8} for adafactor")
    max_grad_norm: Number | None = Field(None, gt=0, description="clip unscaled gradients to this global norm "
                                                                 "(null: off)")


    @model_validator(mode="after")
    def _min_lr_at_most_lr(self) -> "OptimizerConfig":
        if self.min_lr > self.lr:
            raise invalid(f"optimizer.min_lr ({self.min_lr:g}) must not exceed optimizer.lr ({self.lr:g}): the "
                          f"schedules decay from lr to min_lr")
        return self

    @model_validator(mode="after")
    def _arguments_fit(self) -> "OptimizerConfig":
        """Optax functions' arguments are checked here; a factory's when it is built."""
        try:
            if not is_reference(self.name):
                optimizer_arguments(self, *optax_function(self.name, optax_optimizers()))
            if self.schedule in SCHEDULES and self.schedule_options:
                raise ConfigError(f"optimizer.schedule_options: the built-in schedule {self.schedule!r} takes none; "
                                  f"name an optax schedule (e.g. cosine_decay_schedule) to pass options")
            if self.schedule not in SCHEDULES and not is_reference(self.schedule):
                schedule_arguments(self, *optax_function(self.schedule, optax_schedules()), steps=1)
        except ConfigError as e:
            raise invalid(str(e)) from None
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Callable) -> dict:
        """Beyond the built-ins, a field that is set is passed on: a dump (``config.yaml``,
        ``--print-config``) leaves out the unset ones, so that it reads back the same."""
        data = handler(self)
        if self.name not in OPTIMIZERS:
            unset = set(FIELD_ARGUMENTS) | (set(SCHEDULE_FIELDS) if is_reference(self.name) else set())
            for key in unset - self.model_fields_set:
                data.pop(key, None)
        return data


def optax_function(name: str, catalog: dict[str, Callable]) -> tuple[Callable, str]:
    """The function ``name`` names in an optax ``catalog`` (:func:`optax_optimizers`,
    :func:`optax_schedules`), and how errors name it: ``optax.lamb``, ``optax.contrib.muon``."""
    fn = catalog[name]
    module = getattr(getattr(fn, "func", fn), "__module__", "") or ""
    return fn, f"optax.contrib.{name}" if module.startswith("optax.contrib") else f"optax.{name}"


def parameters(fn: Callable) -> dict[str, inspect.Parameter] | None:
    """``fn``'s parameters by name (None: it has no signature to check against)."""
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def takes(fn: Callable, argument: str) -> bool:
    """Whether ``fn`` has a parameter named ``argument``."""
    params = parameters(fn)
    return params is None or argument in params


def _check_call(fn: Callable, given: dict[str, str], what: str, prefix: str) -> None:
    """``given`` (argument -> the config key it comes from) fits ``fn``'s signature: each
    argument taken, every required one given; else one line naming the key."""
    params = parameters(fn)
    if params is None:
        return
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    names = [k for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for argument, key in given.items():
        if argument not in params and not takes_any:
            close = difflib.get_close_matches(argument, names, n=1)
            hint = f" Did you mean '{prefix}.{close[0]}'?" if close else ""
            raise ConfigError(f"{key}: {what} takes no argument '{argument}'.{hint} Its arguments: "
                              f"{', '.join(names) or 'none'}")
    missing = [k for k, p in params.items() if p.default is p.empty and k not in given
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ConfigError(f"{prefix}.{missing[0]}: {what} needs argument '{missing[0]}'; set "
                          f"{', '.join(prefix + '.' + m for m in missing)}")


def optimizer_arguments(opt: OptimizerConfig, fn: Callable, what: str) -> dict[str, Any]:
    """The keyword arguments, but ``learning_rate``, the config gives optimizer function ``fn``
    (named ``what`` in errors): its options, and for all but the built-ins the fields set
    explicitly that ``fn`` takes (see the module's docstring).

    Raises:
      ConfigError: an argument ``fn`` does not take or one set twice, naming the key.
    """
    if "learning_rate" in opt.options:
        raise ConfigError("optimizer.options.learning_rate: the learning rate comes from optimizer.lr and "
                          "optimizer.schedule")
    kwargs = dict(opt.options)
    given = {k: f"optimizer.options.{k}" for k in kwargs}
    if opt.name in OPTIMIZERS:
        for argument in _BUILTIN_FILLS[opt.name]:
            if argument in kwargs:
                raise ConfigError(f"optimizer.options.{argument}: {opt.name} takes it from optimizer.{argument}; "
                                  f"set that instead")
            given[argument] = f"optimizer.{argument}"
    else:
        params = parameters(fn)
        for field in sorted(set(FIELD_ARGUMENTS) & opt.model_fields_set):
            value = getattr(opt, field)
            argument = next((a for a in FIELD_ARGUMENTS[field] if params is None or a in params), None)
            if argument is None and not (field == "weight_decay" and value == 0):
                argument = field if any(p.kind == p.VAR_KEYWORD for p in params.values()) else None
                if argument is None:
                    raise ConfigError(f"optimizer.{field}: {what} takes no argument '{field}' (optimizer.{field}="
                                      f"{value!r} is set); unset it (optimizer.{field}=null on the command line, or "
                                      f"remove it from the file), or pass what {what} takes in optimizer.options."
                                      f" Its arguments: {', '.join(params)}")
            if argument is None:
                continue
            if argument in kwargs:
                raise ConfigError(f"optimizer.options.{argument}: set twice, as optimizer.{field} too; set one")
            kwargs[argument], given[argument] = value, f"optimizer.{field}"
    if takes(fn, "learning_rate"):
        given["learning_rate"] = "optimizer.lr"
    _check_call(fn, given, what, "optimizer.options")
    return kwargs


def schedule_arguments(opt: OptimizerConfig, fn: Callable, what: str, steps: int) -> tuple[dict[str, Any], bool]:
    """The keyword arguments the config gives schedule function ``fn`` for a run of ``steps``
    steps (its schedule_options, the rest filled from the config: see the module's
    docstring), and whether it warms up itself (takes ``warmup_steps``).

    Raises:
      ConfigError: an option ``fn`` does not take, or a required one missing, naming the key.
    """
    params = parameters(fn) or {}
    own_warmup = "warmup_steps" in params
    warmup = min(opt.warmup_steps, steps)
    after = max(steps - warmup, 1)
    fills = {"value": opt.lr, "peak_value": opt.lr, "lr": opt.lr, "learning_rate": opt.lr,
             "init_value": 0.0 if "peak_value" in params else opt.lr, "warmup_steps": warmup,
             "decay_steps": warmup + after if own_warmup else after, "steps": warmup + after if own_warmup else after,
             "transition_steps": after, "end_value": opt.min_lr, "min_lr": opt.min_lr, "alpha": opt.min_lr / opt.lr}
    min_lr_set = "min_lr" in opt.model_fields_set
    kwargs = dict(opt.schedule_options)
    for argument, value in fills.items():
        p = params.get(argument)
        if p is not None and argument not in kwargs and (
                argument not in ("end_value", "min_lr", "alpha") or min_lr_set or p.default is p.empty):
            kwargs[argument] = value
    given = {k: f"optimizer.schedule_options.{k}" for k in kwargs}
    _check_call(fn, given, what, "optimizer.schedule_options")
    return kwargs, own_warmup
